"""The what-if replay: re-time a measured step under a changed schedule (issue 27).

- `replay.py`: the engine, one step model (`rank/step_model.py`) in, its replayed timeline out;
- `platform.py`: what can overlap what on this run's device, and the collective cost fitted on
  the run itself (alpha-beta per process group and kind, with its fit error);
- `counterfactuals.py`: the changes (prefetch depth, reshard after forward, a coarser wrap, host
  syncs removed, checkpointing, stragglers removed), each a function from a step model to a step
  model; `finer_wrap.py` (a unit split into the captured model's blocks), `micro_batch.py`
  (the passes run K times) and `mesh_shape.py` (another HSDP mesh shape; HSDP's all-reduces
  kept once per step) are more;
- `change_checks.py`: what each change assumes on a run, or why it cannot apply there;
- `run_whatif.py`: a change applied to every rank's modelled steps, predicted against measured.
"""
