"""Apply zdiag's recommendation code to the models it was written for (one process, world size 1,
gloo on CPU); run by tests/integration/runs/test_recommendations_apply.py as a child process, so the process group
and FSDP state never touch the test process.

For each model (the user zoo's own classes, imported from their modules, and the harness's
Transformer) and framework: wrap the model the misconfigured way (FSDP2 `fully_shard(model)` only,
FSDP1 `FSDP(model)` without a policy, DDP), describe it as `zdiag run` does at the first forward
(`describe_model`), build the detectors' facts from that description (`DetectorContext.sheet.run_facts`) and ask
the framework for each remedy. Every remedy's code is then executed on a fresh, unwrapped model of
the same class with the names the code expects (`model`; the code imports the rest), and one
forward and backward must run. Prints one JSON line per (model, framework, remedy).

    python tests/support/apply_recommendations.py [model ...]
    python tests/support/apply_recommendations.py --code FILE MODEL FRAMEWORK  # one snippet
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "user_zoo"))

from zdiag.analyzers import frameworks  # noqa: E402
from zdiag.analyzers.detectors.context import DetectorContext  # noqa: E402
from zdiag.analyzers.frameworks import checkpoint_blocks  # noqa: E402
from zdiag.analyzers.inputs.model_facts import ModelFacts  # noqa: E402
from zdiag.collectors.model_capture import describe_model  # noqa: E402


@dataclass(frozen=True)
class Case:
    """A model: how to build a small one, and its loss on a synthetic batch."""

    name: str
    build: Callable[[], nn.Module]
    loss: Callable[[nn.Module], torch.Tensor]


def _cases() -> dict[str, Case]:
    import convnet
    import moe
    import recsys
    import seq2seq
    import tabular

    from zdiag.harness.model import ModelArgs, Transformer

    g = torch.Generator().manual_seed(0)

    def tab_loss(m: nn.Module) -> torch.Tensor:
        x, y = tabular.random_rows(8, 16, g)
        return F.cross_entropy(m(x), y)

    def trunk_loss(m: nn.Module) -> torch.Tensor:
        return m(torch.randn(8, 12, generator=g)).square().mean()

    def cnn_loss(m: nn.Module) -> torch.Tensor:
        x, y = convnet.random_images(4, 8, g)
        return F.cross_entropy(m(x), y)

    def s2s_loss(m: nn.Module) -> torch.Tensor:
        src, dec_in, tgt = seq2seq.copy_task(4, 6, 50, g)
        return F.cross_entropy(m(src, dec_in).flatten(0, 1), tgt.flatten())

    def moe_loss(m: nn.Module) -> torch.Tensor:
        tokens = moe.token_batch(4, 6, 64, g)
        return F.cross_entropy(m(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())

    def rec_loss(m: nn.Module) -> torch.Tensor:
        dense, ids, y = recsys.click_batch(8, 2, 50, g)
        return F.binary_cross_entropy_with_logits(m(dense, ids), y)

    def llama_loss(m: nn.Module) -> torch.Tensor:
        tokens = torch.randint(0, 64, (2, 9), generator=g)
        logits = m(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    return {
        c.name: c
        for c in (
            Case("tabular", lambda: tabular.TabularResNet(16, 32, 64, 3), tab_loss),
            Case("trunk", lambda: tabular.MLPTrunkNet(12, 32, 64, 3), trunk_loss),
            Case("convnet", lambda: convnet.ConvNet(channels=8, depth=3), cnn_loss),
            Case(
                "seq2seq",
                lambda: seq2seq.Seq2Seq(vocab=50, dim=16, heads=2, depth=2),
                s2s_loss,
            ),
            Case(
                "moe",
                lambda: moe.MoEModel(vocab=64, dim=16, hidden=32, n_experts=2, depth=2),
                moe_loss,
            ),
            Case(
                "recsys",
                lambda: recsys.Recommender(n_sparse=2, cardinality=50, emb_dim=4, depth=2),
                rec_loss,
            ),
            Case(
                "harness",
                lambda: Transformer(ModelArgs(layers=3, dim=32, heads=4, vocab=64, seq=8)),
                llama_loss,
            ),
        )
    }


def misconfigured(model: nn.Module, framework: str) -> nn.Module:
    """The model wrapped as a whole (FSDP2/FSDP1: one unit; DDP: replicated)."""
    if framework == "fsdp2":
        fully_shard(model)
        return model
    if framework == "fsdp1":
        return FSDP(model, device_id=torch.device("cpu"))
    return DDP(model)


def remedies(case: Case, framework: str) -> tuple[list[tuple[str, list[str]]], dict[str, Any]]:
    """[(remedy name, code snippets to run in order)] for `case` under `framework`, from the
    description of its misconfigured model, and what the facts said."""
    desc = describe_model(misconfigured(case.build(), framework))
    ctx = DetectorContext(ledgers={}, model=ModelFacts(desc, source="in-process"))
    fw = frameworks.get(framework)
    facts = ctx.sheet.run_facts(fw)
    wrap = fw.wrap_blocks(facts)
    out: list[tuple[str, list[str]]] = []
    wrap_code = wrap.code if wrap is not None else None
    if wrap_code:
        out.append(("wrap_blocks", [wrap_code]))
    overlap = fw.overlap(facts)
    if overlap is not None and overlap.code:
        # the code is whole: FSDP2's wraps the blocks before naming them in prefetch lists when
        # they are not units yet, FSDP1's and DDP's code wraps
        out.append(("overlap", [overlap.code]))
    if framework == "fsdp2" and facts.blocks is not None and facts.blocks.containers:
        # a run that chains its blocks but not the root: only the root's link, to the first unit
        chained = {**facts.settings, "forward_prefetch": True, "backward_prefetch": True}
        first = f"{facts.blocks.containers[0]}.0"
        root = fw.overlap(
            dataclasses.replace(facts, settings=chained, first_unit=first, blocks_are_units=True)
        )
        if root is not None and root.code:
            out.append(("root_prefetch", [wrap_code, root.code]))
    bf16 = fw.bf16_comm(facts)
    if bf16 is not None and bf16.code and framework != "ddp":  # gloo all_reduce has no bf16 hook
        out.append(("bf16_comm", [bf16.code]))
    ckpt = checkpoint_blocks(facts.blocks, fw.checkpoint_note)
    if ckpt is not None and ckpt.code and wrap_code:
        out.append(("checkpoint_blocks", [ckpt.code, wrap_code]))
    info = {
        "blocks": facts.blocks.describe() if facts.blocks else None,
        "blocks_are_units": facts.blocks_are_units,
        "wrap_code": wrap_code,
    }
    return out, info


def units_after(model: nn.Module) -> int:
    """FSDP units in the model (FSDP2 modules or FSDP1 instances)."""
    return sum(1 for m in model.modules() if isinstance(m, (FSDPModule, FSDP)))


class _CpuFSDP(FSDP):
    """FSDP1 as the zoo's FSDP1 scripts construct it on CPU: with `device_id=cpu` (FSDP1 refuses
    a CPU-only machine without it). The remedies' `FSDP(...)` calls say the user's own arguments
    stay (`frameworks.fsdp1.KEEP_ARGS`): this adds the one a CPU run has."""

    def __init__(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("device_id", torch.device("cpu"))
        super().__init__(module, *args, **kwargs)


def apply(case: Case, framework: str, codes: list[str]) -> dict[str, Any]:
    """Execute `codes` on a fresh model, then one forward and backward."""
    model = case.build()
    names: dict[str, Any] = {"model": model}
    for code in codes:
        exec(compile(code, f"<{case.name}:{framework}>", "exec"), names)
    model = names["model"]
    loss = case.loss(model)
    loss.backward()
    grads = sum(1 for p in model.parameters() if p.grad is not None)
    return {"units": units_after(model), "params_with_grad": grads, "loss": float(loss)}


def main(argv: list[str]) -> int:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    if not torch.cuda.is_available():
        torch.distributed.fsdp.FullyShardedDataParallel = _CpuFSDP  # type: ignore[misc]
    cases = _cases()
    if argv[:1] == ["--code"]:
        path, name, framework = argv[1:4]
        row: dict[str, Any] = {"model": name, "framework": framework, "remedy": path}
        try:
            row.update(apply(cases[name], framework, [Path(path).read_text()]))
        except Exception:
            row["error"] = traceback.format_exc()
        print(json.dumps(row), flush=True)
        dist.destroy_process_group()
        return 0
    for name in argv or list(cases):
        case = cases[name]
        for framework in ("fsdp2", "fsdp1", "ddp"):
            torch.manual_seed(0)
            try:
                todo, info = remedies(case, framework)
            except Exception:
                row = {"model": name, "framework": framework, "remedy": "(facts)"}
                print(json.dumps({**row, "error": traceback.format_exc()}), flush=True)
                continue
            for remedy, codes in todo:
                row = {"model": name, "framework": framework, "remedy": remedy, **info}
                try:
                    row.update(apply(case, framework, codes))
                except Exception:
                    row["error"] = traceback.format_exc()
                row["code"] = "\n".join(codes)
                print(json.dumps(row), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
