"""Hardware profiles: what a cluster's nodes hold and how jobs must be started there.

A profile (profiles/<name>.yaml) fixes GPUs and memory per node, the vendor and its collectives
settings, node-local NVMe for optimizer offload, the container image, Slurm partition limits and
extra sbatch flags, and recipe defaults that sit *under* the recipe (the recipe and `--set` win).
Profiles only describe; `miles.launch.plan` checks a recipe against one and renders the job.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from miles.config.base import ConfigError, Section, explain
from miles.config.loading import read_yaml

PROFILES_DIR = Path(__file__).resolve().parents[2] / "profiles"

Fp8Format = Literal["e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz", "mxfp8", "nvfp4"]
"""Low-precision formats a GPU computes in (docs/fp8.md): OCP FP8 e4m3fn / e5m2 (H100 and later,
MI355X), the fnuz variants of MI300, Blackwell's microscaled MXFP8 (1x32 blocks, UE8M0 scales) and
NVFP4 (1x16 blocks, E4M3 scales and a per-tensor fp32 scale)."""

FP8_FORMAT_NEEDED: dict[str, dict[str, str]] = {
    "engine.quantization": {"fp8_block": "e4m3fn", "fp8_row": "e4m3fn", "mxfp8": "mxfp8", "nvfp4": "nvfp4"},
    "train.quantization": {"torchao_float8": "e4m3fn"},
}
"""The format each recipe value computes in (train.quantization=fake_quant needs none: it dequantises;
int4 is W4A16, 16-bit arithmetic on any GPU)."""
EMULATED_FORMATS = ("mxfp8", "nvfp4")
"""Formats the embedded engine emulates (dequantises) where the GPUs lack them: a profile without them
still runs them with engine.kind=embedded; SGLang servers need GPUs that compute in them (GB300, B200)."""


class PartitionLimits(Section):
    """What one Slurm partition of the cluster allows."""

    max_nodes: int
    """Most nodes one job may take in this partition."""
    max_time_min: int | None = None
    """Longest time limit in minutes (None: no limit)."""


class CollectivesProfile(Section):
    """NCCL / RCCL / gloo settings exported to every rank."""

    backend: Literal["nccl", "rccl", "gloo"] = "nccl"
    """Collective library of the trainer (gloo on CPU-only clusters)."""
    socket_ifname: str | None = None
    """Network interface for bootstrap sockets (NCCL_/GLOO_/TP_SOCKET_IFNAME)."""
    ib_hca: str | None = None
    """InfiniBand / RoCE adapters (NCCL_IB_HCA)."""
    heartbeat_timeout_s: int = 480
    """Watchdog: a rank whose collectives make no progress this long is dumped and aborted."""
    flight_recorder_entries: int = 20000
    """Collectives kept in the flight-recorder ring buffer (0: off)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Further vendor variables (e.g. NCCL_NVLS_ENABLE, NCCL_IB_GID_INDEX, RCCL_MSCCL_ENABLE)."""


class NvmeProfile(Section):
    """Node-local NVMe drives usable for streaming optimizer state."""

    paths: list[str] = Field(default_factory=list)
    """Mount points of node-local NVMe (first one is used for offload)."""
    offload_by_default: bool = False
    """Set train.optimizer_offload=nvme with train.offload_dir on the first path unless the recipe says otherwise."""


class ContainerSandboxConfig(Section):
    """How episode sandboxes run in a container runtime on a cluster's nodes (miles/agentic/sandbox/
    container.py): a profile's `container.sandbox`, a run's `rollout.env.sandbox`."""

    runtime: Literal["apptainer", "enroot"] = "apptainer"
    """Container runtime on the compute nodes."""
    image: str | None = None
    """Image of the sandboxes (None: the profile's `container.image`; Harbor episodes: the task's own)."""
    image_dir: str | None = None
    """Directory of images pulled ahead (nodes without registry access): a registry image
    `docker://NAME:TAG` is run from the file the runtime's own pull writes here, `NAME_TAG.sif`
    (`apptainer pull`) or `NAME+TAG.sqsh` (`enroot import`), and a missing file is an error naming
    the command that pulls it. None: straight from the registry."""
    network: Literal["none", "egress", "host"] = "none"
    """`none`: only a loopback inside; `egress` (apptainer): a network namespace with a route out
    through pasta and a loopback of its own (miles/agentic/sandbox/egress.py); `host`: the node's
    network (tools that must download). A Harbor task that allows the internet gets `egress` on
    apptainer where the node has it."""
    egress_to_host: bool = False
    """With egress, the gateway's address reaches the node's loopback (tests only: egress.py)."""
    root: str = "/tmp/miles-sandbox"
    """Node-local directory holding the per-episode directories (never the run directory)."""
    prlimit: str = "/usr/bin/prlimit"
    """prlimit inside the image."""
    extra_args: list[str] = []
    """Further runtime flags, placed before the image (e.g. --nv to see GPUs)."""


class ContainerProfile(Section):
    """The image every srun step runs in (pyxis / enroot), and the runtime of episode sandboxes."""

    enabled: bool = False
    """Run steps in a container (srun --container-image ...)."""
    image: str | None = None
    """Squashfs path or registry reference of the image (see containers/README.md)."""
    recipe: str | None = None
    """Image recipe in containers/ this image is built from."""
    mounts: list[str] = Field(default_factory=list)
    """SRC:DST mounts; the run directory is always mounted at the same path."""
    workdir: str | None = None
    """Working directory inside the container."""
    sandbox: ContainerSandboxConfig | None = None
    """How agent episodes' sandboxes run on these nodes (e.g. {runtime: enroot}): jobs submitted with
    this profile get it as `rollout.env.sandbox` unless the recipe sets one. None: bubblewrap."""


class DetectRule(Section):
    """How `miles profiles detect` recognises this profile from the GPUs it sees."""

    name_contains: list[str] = Field(default_factory=list)
    """Substrings of the NVML / amdsmi device name (case-insensitive)."""
    gfx: list[str] = Field(default_factory=list)
    """AMD graphics target versions (e.g. gfx950)."""


class Profile(Section):
    """One kind of cluster node and its Slurm conventions."""

    name: str
    """Profile name (the file stem)."""
    description: str = ""
    """One line for `miles profiles list`."""
    vendor: Literal["nvidia", "amd", "cpu"]
    """GPU vendor, or cpu for clusters without GPUs."""
    gpus_per_node: int = 0
    """GPUs per node (0 on CPU-only nodes)."""
    gpu_mem_gb: float = 0.0
    """Memory of one GPU in GB."""
    host_mem_gb: float
    """Host memory per node in GB."""
    cpus_per_node: int
    """CPU cores per node."""
    partition: str | None = None
    """Default Slurm partition (None: the cluster's default)."""
    partitions: dict[str, PartitionLimits] = Field(default_factory=dict)
    """Limits per partition; a job asking for more is refused before submission."""
    max_nodes: int = 1024
    """Most nodes one job may take when the partition has no entry in `partitions`."""
    constraint: str | None = None
    """Slurm --constraint for every component."""
    account: str | None = None
    """Slurm --account."""
    sbatch_flags: list[str] = Field(default_factory=list)
    """Extra sbatch flags for every component (e.g. --segment=18 for one NVL72 domain)."""
    srun_flags: list[str] = Field(default_factory=list)
    """Extra srun flags for every step."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines run in the batch script before any step (module loads, ...)."""
    bootstrap: Literal["slurm", "mpi"] = "slurm"
    """Rank discovery: Slurm variables, or mpi4py under srun --mpi=pmix."""
    engine_host: Literal["loopback", "node"] = "node"
    """Address engines bind and publish: loopback (one-host clusters) or the node's address."""
    requeue_signal_s: int = 120
    """Seconds before the time limit the batch shell gets USR2 (checkpoint, then requeue)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Variables exported to every step (HSA_*, GPU_MAX_HW_QUEUES, ...)."""
    collectives: CollectivesProfile = CollectivesProfile()
    nvme: NvmeProfile = NvmeProfile()
    container: ContainerProfile = ContainerProfile()
    detect: DetectRule = DetectRule()
    recipe_defaults: dict[str, Any] = Field(default_factory=dict)
    """Recipe keys set by this profile unless the recipe or --set says otherwise."""
    fp8_formats: list[Fp8Format] | None = None
    """Low-precision formats the GPUs compute in (e4m3fn, e5m2, mxfp8, nvfp4, ...); None: not stated, unchecked."""


def known_profiles(directory: Path = PROFILES_DIR) -> list[str]:
    """Names of the profiles shipped in `directory`."""
    return sorted(p.stem for p in directory.glob("*.yaml"))


def load_profile(name_or_path: str, directory: Path = PROFILES_DIR) -> Profile:
    """A profile by name (profiles/<name>.yaml) or by path to a YAML file; errors list the known names."""
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        path = directory / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ConfigError(
            f"unknown profile {name_or_path!r}; known profiles: {', '.join(known_profiles(directory))} "
            f"(or pass the path of a profile YAML file)"
        )
    data = read_yaml(path)
    data.setdefault("name", path.stem)
    try:
        return Profile.model_validate(data)
    except ValidationError as e:
        raise explain(e, Profile, source=f"profile {path}") from None


def check_fp8_formats(profile: Profile, values: dict[str, str], *, emulate: bool = False) -> None:
    """Refuse recipe values (e.g. {"engine.quantization": "fp8_block"}) whose format the profile lacks;
    with `emulate` (the embedded engine) the Blackwell formats pass: it dequantises them."""
    if profile.fp8_formats is None:
        return
    for key, value in values.items():
        needed = FP8_FORMAT_NEEDED.get(key, {}).get(value)
        if emulate and needed in EMULATED_FORMATS:
            continue
        if needed is not None and needed not in profile.fp8_formats:
            have = ", ".join(profile.fp8_formats) or "none"
            raise ConfigError(
                f"{key}={value} computes in {needed}, which profile {profile.name!r} does not list in "
                f"fp8_formats (it lists: {have}); set {key}=none or use a profile whose GPUs have {needed}"
            )


def profile_defaults(profile: Profile) -> dict[str, Any]:
    """Recipe defaults of a profile, including NVMe offload when the profile turns it on."""
    from miles.config.loading import deep_merge

    derived: dict[str, Any] = {"launch": {"profile": profile.name}}
    if profile.container.sandbox is not None:
        derived["rollout"] = {"env": {"sandbox": profile.container.sandbox.model_dump(mode="json")}}
    if profile.nvme.offload_by_default and profile.nvme.paths:
        derived["train"] = {
            "optimizer_offload": "nvme",
            "offload_dir": f"{profile.nvme.paths[0].rstrip('/')}/miles-offload",
        }
    return deep_merge(derived, profile.recipe_defaults)
