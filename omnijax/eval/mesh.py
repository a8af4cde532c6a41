"""Meshes, shardings and multi-host start-up for evaluating many sessions at once (`omnijax.evaluate`).

A mesh has two named axes: `data` (sessions are split over it) and `model` (a decoder too large for one device
splits its attention heads, MLP intermediate and vocabulary over it). Everything else is left to XLA's SPMD
partitioner: arrays are placed with `jax.sharding.NamedSharding`s and the jitted scan is partitioned from them; no
collective is written by hand.

Parameter placement (`decoder_param_specs`, the stacked layout of `omnijax.models.decoder`, `[L, ...]` leading):

    q_proj [L, D, H*d] / q_bias [L, H*d]        H*d over `model` when H divides by the model axis
    k_proj, v_proj [L, D, G*d] / k_bias, v_bias  G*d over `model` when G divides by it (else replicated)
    o_proj [L, H*d, D]                           H*d over `model` (the partial sums are reduced by XLA)
    gate_proj, up_proj [L, D, I] / down_proj [L, I, D]   I over `model`
    expert_gate, expert_up, expert_down [Lm, E, ...]    E over `model` (expert parallel) when E divides by it
                                                         (per-layer [E, ...] arrays of a split decoder alike)
    lm_head [D, V]                               V over `model`
    embed, norms                                 replicated

A quantised weight (`omnijax.kernels.quant.QuantizedWeight`) follows its float weight's rule in each of its arrays
(codes, scales, offsets): the expert and output-column axes split alike; an input-row axis (o_proj, down_proj) splits
only in the arrays whose length there divides by the model axis (a per-channel scale row stays whole).

Multi-host: every process runs the same program on the same host data. `initialize` calls
`jax.distributed.initialize` from flags or environment variables (before any other JAX call), inputs become global
arrays with `jax.make_array_from_callback` (each process fills only its addressable shards) and `to_host` gathers
results with `multihost_utils.process_allgather` when they are not fully addressable. On CPU the cross-process
collectives are gloo's (`jax_cpu_collectives_implementation`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from omnijax.kernels.quant import QuantizedWeight
from omnijax.models.config import DecoderConfig
from omnijax.streaming.step import StreamState

DATA, MODEL = "data", "model"

ENV_COORDINATOR = "OMNIJAX_COORDINATOR_ADDRESS"  # host:port of process 0 (JAX_COORDINATOR_ADDRESS also works)
ENV_NUM_PROCESSES = "OMNIJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "OMNIJAX_PROCESS_ID"
ENV_LOCAL_DEVICES = "OMNIJAX_LOCAL_DEVICE_IDS"  # comma-separated, optional


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Where this process sits in a multi-process run.

    Attributes:
        coordinator: `host:port` of process 0's coordination service.
        num_processes: processes in the run (one per host, or one per GPU).
        process_id: this process's index in `[0, num_processes)`.
        local_device_ids: devices this process drives (default: all visible ones).
    """

    coordinator: str
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id {self.process_id} must lie in [0, num_processes={self.num_processes})")
        if ":" not in self.coordinator:
            raise ValueError(f"coordinator must be host:port, got {self.coordinator!r}")


def cluster_from_env(env: Mapping[str, str] | None = None) -> ClusterSpec | None:
    """A `ClusterSpec` from `OMNIJAX_*` (or `JAX_COORDINATOR_ADDRESS`) variables; None when no coordinator is set."""
    env = os.environ if env is None else env
    coordinator = env.get(ENV_COORDINATOR) or env.get("JAX_COORDINATOR_ADDRESS")
    if not coordinator:
        return None
    missing = [k for k in (ENV_NUM_PROCESSES, ENV_PROCESS_ID) if not env.get(k)]
    if missing:
        raise ValueError(f"{ENV_COORDINATOR} is set but {', '.join(missing)} is not")
    local = env.get(ENV_LOCAL_DEVICES)
    return ClusterSpec(coordinator, int(env[ENV_NUM_PROCESSES]), int(env[ENV_PROCESS_ID]),
                       tuple(int(i) for i in local.split(",")) if local else None)


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    """Adds `--coordinator`, `--num-processes`, `--process-id`, `--local-device-ids` (flags override the env)."""
    group = parser.add_argument_group("multi-host (jax.distributed)")
    group.add_argument("--coordinator", help=f"host:port of process 0 (env {ENV_COORDINATOR})")
    group.add_argument("--num-processes", type=int, help=f"processes in the run (env {ENV_NUM_PROCESSES})")
    group.add_argument("--process-id", type=int, help=f"this process's index (env {ENV_PROCESS_ID})")
    group.add_argument("--local-device-ids", help=f"comma-separated local device ids (env {ENV_LOCAL_DEVICES})")
    group.add_argument("--auto-cluster", action="store_true",
                       help="let JAX detect the cluster (SLURM, Open MPI, ...) instead of the flags above")


def cluster_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> ClusterSpec | str | None:
    """The `ClusterSpec` of parsed `add_cluster_flags` flags, falling back to the environment field by field
    (`"auto"` with `--auto-cluster`)."""
    if getattr(args, "auto_cluster", False):
        return "auto"
    base = cluster_from_env(env)
    coordinator = args.coordinator or (base.coordinator if base else None)
    if coordinator is None:
        if args.num_processes or args.process_id is not None:
            raise ValueError("--num-processes/--process-id need --coordinator (or its environment variable)")
        return None
    num = args.num_processes if args.num_processes is not None else (base.num_processes if base else None)
    pid = args.process_id if args.process_id is not None else (base.process_id if base else None)
    if num is None or pid is None:
        raise ValueError("a multi-process run needs --num-processes and --process-id (or their env variables)")
    local = (tuple(int(i) for i in args.local_device_ids.split(",")) if args.local_device_ids
             else (base.local_device_ids if base else None))
    return ClusterSpec(coordinator, num, pid, local)


def initialize(spec: ClusterSpec | str | None = None, *, cpu_collectives: str = "gloo") -> bool:
    """Joins a multi-process run; call it before any other JAX computation.

    Args:
        spec: the cluster; default `cluster_from_env()` (None there means a single-process run: nothing to do).
            `"auto"` lets JAX detect the cluster itself (SLURM, Open MPI, ...: `jax.distributed.initialize()`).
        cpu_collectives: cross-process collectives on CPU ("gloo" or "mpi"); ignored on GPU.

    Returns:
        True when `jax.distributed.initialize` was called.
    """
    spec = cluster_from_env() if spec is None else spec
    if spec is None:
        return False
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    if spec == "auto":
        jax.distributed.initialize()
        return True
    jax.distributed.initialize(spec.coordinator, num_processes=spec.num_processes, process_id=spec.process_id,
                               local_device_ids=list(spec.local_device_ids) if spec.local_device_ids else None)
    return True


def is_main_process() -> bool:
    """True on process 0 (the one that prints, draws progress bars and writes files)."""
    return jax.process_index() == 0


def make_mesh(data: int | None = None, model: int = 1, *, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `(data, model)` mesh over `devices` (default: every device of every process).

    `data` defaults to `len(devices) // model`. Axes are `AxisType.Auto`, so XLA propagates shardings through the
    embedding gather and the scan (explicit axes would refuse the gather).
    """
    devices = list(jax.devices() if devices is None else devices)
    if model < 1 or len(devices) % model:
        raise ValueError(f"model axis {model} must divide the {len(devices)} devices")
    data = len(devices) // model if data is None else data
    if data * model != len(devices):
        raise ValueError(f"mesh {data} x {model} needs {data * model} devices, got {len(devices)}")
    return jax.make_mesh((data, model), (DATA, MODEL), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=devices)


def axis_size(mesh: Mesh | None, name: str) -> int:
    """Size of a mesh axis (1 without a mesh or without that axis)."""
    return 1 if mesh is None or name not in mesh.shape else int(mesh.shape[name])


def _leaf_name(path) -> str:
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    names = [n for n in names if isinstance(n, str) and n != "value"]
    return names[-1] if names else ""


def decoder_param_specs(params: Any, config: DecoderConfig, mesh: Mesh | None) -> Any:
    """PartitionSpecs for a decoder's parameter pytree (`nnx.split(decoder)[1]`), by parameter name (table above)."""
    m = axis_size(mesh, MODEL)
    heads = m > 1 and config.num_heads % m == 0
    kv_heads = m > 1 and config.num_kv_heads % m == 0
    rules = {"q_proj": (-1, heads), "q_bias": (-1, heads), "o_proj": (-2, heads),
             "k_proj": (-1, kv_heads), "v_proj": (-1, kv_heads), "k_bias": (-1, kv_heads), "v_bias": (-1, kv_heads),
             "gate_proj": (-1, m > 1 and config.intermediate_size % m == 0),
             "up_proj": (-1, m > 1 and config.intermediate_size % m == 0),
             "down_proj": (-2, m > 1 and config.intermediate_size % m == 0),
             "lm_head": (-1, m > 1 and config.vocab_size % m == 0)}
    experts = m > 1 and config.num_experts % m == 0  # expert parallel: each device holds E / m experts
    # the expert axis counted from the end: [Lm, E, in, out] stacked, [E, in, out] per layer (split_layers)
    rules.update({name: (-3, experts) for name in ("expert_gate", "expert_up", "expert_down")})

    def one(axis: int, array: Any) -> P:
        if array.shape[axis] % m:
            return P()
        dims = [None] * array.ndim
        dims[axis] = MODEL
        return P(*dims)

    def spec(path, leaf):
        axis, split = rules.get(_leaf_name(path), (0, False))
        if isinstance(leaf, QuantizedWeight):
            parts = [None if a is None else one(axis, a) if split else P()
                     for a in (leaf.values, leaf.scales, leaf.offsets)]
            return QuantizedWeight(*parts, leaf.scheme, leaf.kernel)
        return one(axis, leaf) if split else P()

    return jax.tree_util.tree_map_with_path(spec, params, is_leaf=lambda x: isinstance(x, QuantizedWeight))


def kv_heads_axis(config: DecoderConfig, mesh: Mesh | None) -> str | None:
    """`model` when the KV heads split over it (then the cache's head axis does too), else None."""
    m = axis_size(mesh, MODEL)
    return MODEL if m > 1 and config.num_kv_heads % m == 0 else None


def session_state_specs(state: StreamState, config: DecoderConfig, mesh: Mesh | None) -> Any:
    """Specs for a `StreamState` with a leading session axis: sessions over `data`; cached K/V
    (`[S, L, N, P, G, d]`) also split their heads over `model` when the KV projections do."""
    heads = kv_heads_axis(config, mesh)

    def spec(path, leaf):
        if _leaf_name(path) in ("k", "v") and leaf.ndim == 6:
            return P(DATA, None, None, None, heads, None)
        return P(DATA)

    return jax.tree_util.tree_map_with_path(spec, state)


def put(tree: Any, mesh: Mesh, specs: Any) -> Any:
    """Places a host (or single-device) pytree on the mesh as global arrays, one `PartitionSpec` per leaf.

    Works in multi-process runs: every process passes the same full values and fills only its own shards.
    """
    def one(x, spec):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda index: host[index])

    return jax.tree.map(one, tree, specs)


def put_sessions(tree: Any, mesh: Mesh) -> Any:
    """Places a host pytree whose leaves all have a leading session axis: that axis over `data`."""
    return put(tree, mesh, jax.tree.map(lambda _: P(DATA), tree))


def to_host(tree: Any) -> Any:
    """Numpy copies of a pytree of (possibly multi-process) global arrays; every process gets everything."""

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(one, tree)


__all__ = ["ClusterSpec", "DATA", "MODEL", "add_cluster_flags", "axis_size", "cluster_from_args", "cluster_from_env",
           "decoder_param_specs", "initialize", "is_main_process", "kv_heads_axis", "make_mesh", "put",
           "put_sessions", "session_state_specs", "to_host"]
