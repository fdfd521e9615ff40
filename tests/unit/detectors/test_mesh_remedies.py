"""FSDP2 remedies pass the run's own mesh (issue 26, item 4): the mesh the units shard over, taken
from the captured description (`model_fsdp_mesh`), rebuilt in the code under the run's own shape,
dimension names and device type; a flat run's code has no mesh at all."""

from __future__ import annotations

from dataclasses import replace
from math import prod

from zdiag.analyzers.detectors.facts import model_fsdp_mesh
from zdiag.analyzers.frameworks import BlockSet, FsdpMesh, RunFacts, fsdp2
from zdiag.analyzers.inputs.model_facts import ModelFacts
from zdiag.collectors.model_schema import DeviceMeshInfo, Fsdp2Unit, MeshDim, ModelDescription

STAGES = BlockSet(container="encoder.stages", block_class="ResidualMLP", count=4)
FLAT_WRAP = (
    "from torch.distributed.fsdp import fully_shard\n"
    "for block in model.encoder.stages:\n"
    "    fully_shard(block)\n"
    "fully_shard(model)"
)


def described(
    shape: tuple[int, ...],
    dims: tuple[tuple[str, str], ...],
    ranks: tuple[int, ...] | None = None,
    device_type: str = "cpu",
) -> ModelFacts:
    """A captured FSDP2 description whose root unit shards over a mesh of `shape` with
    (name, role) `dims`."""
    names = tuple(n for n, _ in dims)
    fsdp = tuple(n for n, role in dims if role in ("shard", "replicate"))
    mesh = DeviceMeshInfo(
        shape=shape,
        dim_names=names,
        device_type=device_type,
        ranks=ranks if ranks is not None else tuple(range(prod(shape))),
        dims=tuple(MeshDim(n, s, role) for (n, role), s in zip(dims, shape, strict=True)),
    )
    unit = Fsdp2Unit(path="", cls="TabResNet", mesh_dim_names=fsdp, hsdp=len(fsdp) == 2)
    return ModelFacts(ModelDescription(framework="fsdp2", fsdp2_units=(unit,), mesh=mesh))


def wrap_code(mesh: FsdpMesh | None) -> str | None:
    remedy = fsdp2.wrap_blocks(
        RunFacts(framework="fsdp2", blocks=STAGES, blocks_are_units=False, mesh=mesh)
    )
    assert remedy is not None
    return remedy.code


def test_hsdp_code_rebuilds_the_runs_2d_mesh_with_its_own_names() -> None:
    mesh = model_fsdp_mesh(described((2, 2), (("replicate", "replicate"), ("shard", "shard"))))
    assert mesh == FsdpMesh(
        (2, 2), ("replicate", "shard"), "cpu", (0, 1, 2, 3), ("replicate", "shard")
    )
    assert wrap_code(mesh) == (
        "from torch.distributed.fsdp import fully_shard\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        '# the run\'s FSDP mesh, rebuilt: (2, 2) ("replicate", "shard")\n'
        'mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))\n'
        "for block in model.encoder.stages:\n"
        "    fully_shard(block, mesh=mesh)\n"
        "fully_shard(model, mesh=mesh)"
    )


def test_fsdp_tp_code_slices_the_data_parallel_dimension() -> None:
    facts = described((2, 2), (("dp", "shard"), ("tp", "tp")), device_type="cuda")
    mesh = model_fsdp_mesh(facts)
    code = wrap_code(mesh)
    assert code is not None
    assert (
        '# the run\'s FSDP mesh, rebuilt: "dp" of (2, 2) ("dp", "tp")\n'
        'dp_mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))["dp"]\n'
    ) in code
    assert code.endswith("    fully_shard(block, mesh=dp_mesh)\nfully_shard(model, mesh=dp_mesh)")
    bf16 = fsdp2.bf16_comm(RunFacts(framework="fsdp2", blocks=STAGES, mesh=mesh))
    assert bf16 is not None and bf16.code is not None
    assert 'dp_mesh = init_device_mesh("cuda"' in bf16.code
    assert "fully_shard(model, mesh=dp_mesh, mp_policy=mp)" in bf16.code


def test_3d_hsdp_plus_tp_slices_both_fsdp_dimensions() -> None:
    dims = (("replicate", "replicate"), ("shard", "shard"), ("tp", "tp"))
    facts = described((2, 2, 2), dims, ranks=tuple(range(8)))
    code = wrap_code(model_fsdp_mesh(facts))
    assert (
        code is not None
        and (
            'dp_mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))'
            '[("replicate", "shard")]'
        )
        in code
    )


def test_a_layout_init_device_mesh_cannot_build_is_given_as_a_device_mesh() -> None:
    facts = described((2, 2), (("dp", "shard"), ("tp", "tp")), ranks=(0, 2, 1, 3))
    code = wrap_code(model_fsdp_mesh(facts))
    assert code is not None
    assert "from torch.distributed.device_mesh import DeviceMesh\n" in code
    assert (
        'dp_mesh = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("dp", "tp"))["dp"]' in code
    )


def test_a_flat_run_keeps_the_code_without_a_mesh() -> None:
    flat = described((4,), (("", "shard"),), ranks=(0, 1, 2, 3))
    assert model_fsdp_mesh(flat) is None
    assert model_fsdp_mesh(ModelFacts(ModelDescription(framework="fsdp2"))) is None
    assert wrap_code(None) == FLAT_WRAP
    # a 2-D mesh FSDP does not use (units without a mesh dimension role): no mesh to pass
    unused = described((2, 2), (("pp", "unused"), ("tp", "tp")))
    assert model_fsdp_mesh(unused) is None
    no_units = replace(unused.description, fsdp2_units=())
    assert model_fsdp_mesh(ModelFacts(no_units)) is None
