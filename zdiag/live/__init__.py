"""The live stream and the live monitor's model: everything of `zdiag monitor` but the drawing.

Training side (imported by the collectors inside every rank; only the standard library, zmq and
`zdiag.errors`, never the analysis, the renderers or the UI: an import-linter contract holds it):

- `wire`: the ``zdiag.live/1`` message format, endpoints and the sending socket.
- `auth`: CURVE keys derived from the job's token, and the receiving end's handshake guard.
- `publisher`: `StepPublisher`, each rank's never-blocking step-record sender.

Monitor side (never imports the UI or the CLI):

- `receiver`: `LiveReceiver` (the monitor's socket) and `Relay` (one node's fan-in, which may run
  inside a rank: it too imports no analysis).
- `history`: what the monitor keeps of one rank (bounded step samples).
- `findings`: the live findings, on the analyzers' thresholds.
- `state`: `MonitorState`, folding records into per-job views the TUI (`zdiag.tui`) only draws.
- `metrics`: the Prometheus/OpenMetrics endpoint (`zdiag monitor --metrics-port`), a collector
  that reads a locked snapshot of the state at each scrape.

This file imports nothing: importing `zdiag.live.publisher` inside training loads no more.
"""
