"""The view layer: renderers that turn a Report into text, JSON, HTML, a Perfetto overlay or the
terminal UI, and what they share, defined once.

- `renderer`: the `Renderer` protocol, `Destination`, the lazy registry `RENDERERS`;
- `format`: durations, sizes (unknown prints "unknown"), shares, lists, evidence values;
- `stats`: per-rank and run statistics, which ranks get detail, the findings' order;
- `columns`: the per-step columns of every view;
- `output`: where outputs are written (never over an input; devices and FIFOs written through).

Renderers read a Report and compute nothing the analysis should have.
"""
