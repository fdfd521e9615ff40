"""The view layer: renderers that turn a Report into the bytes of text, JSON, HTML or a Perfetto
trace (the terminal UI, tui/report_app.py, is a viewer of the same Report), and what they share,
defined once.

- `renderer`: the `Renderer` protocol (Report -> `Rendered`: bytes plus notes), `Destination`,
  and the registry `FORMATS` the commands make their output flags of;
- `format`: durations, sizes (unknown prints "unknown"), shares, lists, evidence values;
- `stats`: per-rank and run statistics, which ranks get detail, the findings' order;
- `columns`: the per-step columns of every view;
- `output`: the one writer (`write_rendered`: never over an input; files atomically; devices and
  FIFOs written through);
- `step_ops`: a step's kernels and ops added up by name (the TUI's ops table).

Renderers read a Report and compute nothing the analysis should have.
"""
