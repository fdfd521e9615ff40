"""Renderers: each turns a Report into one output format (text, HTML, Perfetto overlay)."""
