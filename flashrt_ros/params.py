"""The node's ROS parameters: declarations (with descriptions and ranges) and reading them into settings.

Parameters use dotted namespaces (``sampling.top_k``, ``discretiser.bins``, ``qos.observation.depth``),
as llama_ros does, so a parameter file nests them. What a parameter set at run time does (see
:func:`check_update`):

* ``autostart`` is read once at start-up: read-only.
* ``sampling.*`` (:data:`LIVE`) apply to the next generation that uses the node's defaults.
* every other parameter is read in ``on_configure``: while the node is configured a set is refused with
  the reason (the engine was built with the current value); unconfigured, it takes effect at configure
  (deactivate -> cleanup -> set -> configure -> activate).

So the parameters the node reports are always what its engine uses (the bag header records them).
"""
from dataclasses import dataclass
from typing import Any, Optional

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

from flashrt_ros.discretiser import Discretiser
from flashrt_ros.observation_queue import OVERLOAD_POLICIES
from flashrt_ros.operations import as_float32
from flashrt_ros.runtime import EngineConfig, FlashRTError, SamplingParams
from flashrt_ros.runtime import quant
from flashrt_ros.runtime.kernels import DENSE_GEMV_CHOICES
from flashrt_ros.runtime.speculative import MAX_SPECULATIVE_TOKENS

_INT_MAX = 2**31 - 1

# name, default, description, (low, high) range or None, allowed strings or None
PARAMETERS: list[tuple[str, Any, str, Optional[tuple], Optional[tuple]]] = [
    ("autostart", True, "configure and activate at start (for a plain `ros2 run`)", None, None),
    ("model", "tiny", "tiny | preset name (qwen3.5-0.8b, qwen3.6-27b, ...) | path to a local HF folder", None, None),
    ("device", "cpu", "cpu | cuda | cuda:N", None, None),
    ("dtype", "float32", "weights/activations dtype", None, ("float32", "bfloat16", "float16")),
    ("max_context", 2048, "tokens in the live context; the arena is sized from it", (16, 1 << 20), None),
    ("prefill_chunk", 64, "tokens per prefill chunk, a power of two (one graph bucket)", (1, 1 << 16), None),
    ("cuda_graphs", True, "capture CUDA graphs for prefill/decode (ignored on cpu)", None, None),
    ("kernels", "auto", "kernel set: auto (Triton where a start-up probe passes, else reference) | triton | "
     "reference", None, ("auto", "triton", "reference")),
    ("dense_gemv", "cublas", "dense projections of decode and speculative verify (<= 8 rows) with the Triton kernels: "
     "cublas, or triton (one Triton GEMV each, with the norm, silu_mul and residual add fused; its capsules do not "
     "move to a cublas engine)", None, DENSE_GEMV_CHOICES),
    ("weights_format", "dense", "weight quantization: dense (weights in dtype), fp8 (E4M3) or nvfp4 (4-bit)", None,
     quant.FORMATS),
    ("weights_exclude", "", "comma-separated patterns of projections kept dense, e.g. '*.linear_attn.*,lm_head'",
     None, None),
    ("capsule_budget_mb", 256, "memory all capsules together may use, MiB", (0, 1 << 22), None),
    ("capsule_budget_fraction", 0.0, "on integrated GPUs and the CPU, cap capsule_budget_mb at this share of "
     "MemAvailable at configure (0 = off)", (0.0, 1.0), None),
    ("capsule_dir", "", "folder of capsule files <capsule_dir>/<capsule_id>.capsule for ~/export_capsule and "
     "~/import_capsule; created at configure if missing (\"\" = capsule files disabled: NO_CAPSULE_DIR)", None, None),
    ("capsule_key_file", "", "file whose bytes (at least 16) are the HMAC key that signs exported capsule files and "
     "must sign imported ones (\"\" = unsigned SHA-256 files; a forged file is then not detectable)", None, None),
    ("capsule_evict_policy", "refuse", "when the capsule budget is full: refuse the new capsule, or lru: spill the "
     "least-recently-used unpinned capsules down a tier (pinned host, then capsule_dir)", None, ("refuse", "lru")),
    ("capsule_host_budget_mb", 1024, "pinned host memory capsules may spill to (discrete GPUs only; 0 = none)",
     (0, 1 << 22), None),
    ("max_capsules", 1024, "capsules stored at once on every tier; past it a snapshot, fork or import answers "
     "BUDGET_EXCEEDED", (1, 1 << 20), None),
    ("vision_tower", True, "build and load the model's vision tower when its config has one (false: its weights stay "
     "on disk and observations with images are refused, INVALID_ARGUMENT)", None, None),
    ("image.min_pixels", 65536, "an image with fewer pixels is enlarged to about this many before the vision tower "
     "(Qwen's smart resize: sides multiples of patch_size x spatial_merge_size)", (1, _INT_MAX), None),
    ("image.max_pixels", 1048576, "an image with more pixels is shrunk to at most this many before the vision tower: "
     "bounds its work and the tokens per image (about max_pixels / 1024 with 16-pixel patches merged 2x2)",
     (1, _INT_MAX), None),
    ("image.max_observation_pixels", 4194304, "pixels all images of one observation may take once resized; past it "
     "the observation is refused (INVALID_ARGUMENT)", (1, _INT_MAX), None),
    ("image.max_raw_bytes", 33554432, "largest sensor_msgs/Image data accepted, bytes (larger: INVALID_ARGUMENT, "
     "before any pixel is copied)", (1, _INT_MAX), None),
    ("image.record_pixels", True, "~/events carry each ingested image's pixels (rgb8, 3 bytes per pixel), so a bag "
     "replays on its own; false: only their sha256 (image_digests), and a replay takes the pixels from the bag's "
     "~/observation", None, None),
    ("speculative_tokens", 0, "MTP drafts verified per decode step (0 = off; needs the model's MTP head); > 0 runs "
     "5-row steps whose capsules do not move to an engine with 0 (another decode plan)", (0, MAX_SPECULATIVE_TOKENS), None),
    ("draft_vocab", 0, "MTP drafts pick among the first draft_vocab token ids (0 = all): a smaller head read per draft, "
     "maybe fewer accepted; speed only, the output and capsules are the same for every value", (0, _INT_MAX), None),
    ("history_depth", 32, "commit boundaries kept for rollback(steps=k)", (1, 1 << 16), None),
    ("seed", 0, "weights seed for presets and the sampler seed after reset", (0, 2**63 - 1), None),
    ("sampling.temperature", 0.0, "default sampling temperature (0 = greedy)", (0.0, 100.0), None),
    ("sampling.top_k", 0, "default top-k (0 = off)", (0, _INT_MAX), None),
    ("sampling.top_p", 1.0, "default nucleus top-p in (0, 1] (1 = off)", (0.0, 1.0), None),
    ("stream_chunk_tokens", 8, "tokens per TokenChunk on ~/tokens and per action feedback", (1, 4096), None),
    ("discretiser.low", -1.0, "lowest continuous value (values below clip to the first bin)", None, None),
    ("discretiser.high", 1.0, "highest continuous value (values above clip to the last bin)", None, None),
    ("discretiser.bins", 255, "uniform bins between low and high", (1, 1 << 20), None),
    ("discretiser.token_offset", 257, "token id of bin 0 (tiny: 0-255 bytes, 256 EOS)", (0, _INT_MAX), None),
    ("discretiser.dims", 1, "values per action step", (1, 4096), None),
    ("discretiser.horizon", 1, "action steps per ActionChunk", (1, 4096), None),
    ("qos.observation.reliability", "reliable", "~/observation subscription reliability", None,
     ("reliable", "best_effort")),
    ("qos.observation.depth", 1000, "~/observation subscription queue depth (a burst beyond it is lost, counted "
     "and reported)", (1, 10000), None),
    ("qos.observation.durability", "volatile", "~/observation subscription durability", None,
     ("volatile", "transient_local")),
    ("request_timeout_s", 10.0, "how long a service waits for the engine thread (then TIMEOUT)", (0.01, 3600.0), None),
    ("diagnostics_period_s", 1.0, "period of /diagnostics messages", (0.05, 3600.0), None),
    ("observation_queue.max_bytes", 1 << 25, "bytes of observations (text + 4 per token id and value + 3 per image "
     "pixel) the node queues while the engine is busy; nothing is dropped below it", (1, 1 << 30), None),
    ("observation_queue.overload", "drop_oldest", "past max_bytes: drop_oldest or refuse_new (each one an "
     "observation_dropped event, counted in /diagnostics) or block (drop nothing: stop taking from DDS)", None,
     OVERLOAD_POLICIES),
    ("observation_queue.max_group_bytes", 256, "queued observations appended as one prefill, at most (at least "
     "one): bounds how long an urgent observation waits for a prefill already running", (1, 1 << 30), None),
]


LIVE = ("sampling.temperature", "sampling.top_k", "sampling.top_p")  # take effect at the next generation
READ_ONLY = ("autostart",)  # read once, at start-up


def _when(name: str) -> str:
    if name in READ_ONLY:
        return "read at start-up; read-only"
    if name in LIVE:
        return "applies to the next generation"
    return "read at configure; set it while the node is unconfigured"


def _descriptor(name: str, description: str, bounds: Optional[tuple],
                choices: Optional[tuple]) -> ParameterDescriptor:
    desc = ParameterDescriptor(description=f"{description} ({_when(name)})", read_only=name in READ_ONLY)
    if choices:
        desc.additional_constraints = "one of: " + ", ".join(choices)
    if bounds is not None:
        low, high = bounds
        if isinstance(low, int):
            desc.integer_range = [IntegerRange(from_value=low, to_value=high, step=1)]
        else:
            desc.floating_point_range = [FloatingPointRange(from_value=low, to_value=high, step=0.0)]
    return desc


def declare_parameters(node) -> None:
    """Declare every parameter of :data:`PARAMETERS` on ``node``."""
    for name, default, description, bounds, choices in PARAMETERS:
        node.declare_parameter(name, default, _descriptor(name, description, bounds, choices))


def _check_choices(values: dict) -> None:
    for name, _, _, _, choices in PARAMETERS:
        if choices and name in values and values[name] not in choices:
            raise ValueError(f"parameter {name}={values[name]!r} must be one of {', '.join(choices)}")


def _sampling(values: dict) -> SamplingParams:
    """The sampling defaults as the Session will hold them (float32, as its 'set_sampling' event does), so a value
    that rounds to an invalid one (top_p 1e-46 is 0 in float32) is refused here, with the parameter unchanged."""
    try:
        return SamplingParams(temperature=as_float32(values["sampling.temperature"]), top_k=values["sampling.top_k"],
                              top_p=as_float32(values["sampling.top_p"]))
    except FlashRTError as e:
        raise ValueError(f"sampling.{e.message}") from None


def check_update(node, parameters, configured: bool) -> SamplingParams:
    """The node's sampling defaults once ``parameters`` (rclpy Parameters) are set; ValueError with the
    reason if the set must be refused: a configure-time parameter while ``configured``, a value outside
    its choices, or sampling values the sampler rejects (e.g. ``top_p`` 0)."""
    values = {p.name: p.value for p in parameters}
    frozen = sorted(name for name, *_ in PARAMETERS if name in values and name not in LIVE)
    if configured and frozen:
        raise ValueError(f"{', '.join(frozen)}: read at configure, and the engine is built with the current "
                         "value; deactivate and cleanup the node, set it, then configure and activate")
    _check_choices(values)
    return _sampling({name: values.get(name, node.get_parameter(name).value) for name in LIVE})


@dataclass(frozen=True)
class NodeSettings:
    engine: EngineConfig
    discretiser: Discretiser
    sampling: SamplingParams
    stream_chunk_tokens: int
    observation_qos: QoSProfile
    request_timeout_s: float
    diagnostics_period_s: float
    observation_queue: dict  # ObservationQueue's keyword arguments
    image_limits: dict       # image_convert.ImageLimits' max_raw_bytes and max_observation_pixels
    record_pixels: bool      # ~/events carry the images' pixels (else their digests only)


def read_settings(node) -> NodeSettings:
    """Read the declared parameters; raises ValueError for values the ranges cannot express."""
    p = {name: node.get_parameter(name).value for name, *_ in PARAMETERS}
    _check_choices(p)
    if p["image.min_pixels"] > p["image.max_pixels"]:
        raise ValueError(f"image.min_pixels={p['image.min_pixels']} is above image.max_pixels={p['image.max_pixels']}")
    return NodeSettings(
        engine=EngineConfig(
            model=p["model"], device=p["device"], dtype=p["dtype"], max_context=p["max_context"],
            prefill_chunk=p["prefill_chunk"], cuda_graphs=p["cuda_graphs"], kernels=p["kernels"],
            dense_gemv=p["dense_gemv"],
            capsule_budget_bytes=p["capsule_budget_mb"] << 20, history_depth=p["history_depth"], seed=p["seed"],
            weights_format=p["weights_format"], weights_exclude=quant.parse_patterns(p["weights_exclude"]),
            capsule_budget_fraction=p["capsule_budget_fraction"], capsule_dir=p["capsule_dir"],
            capsule_key_file=p["capsule_key_file"], capsule_evict_policy=p["capsule_evict_policy"],
            capsule_host_budget_bytes=p["capsule_host_budget_mb"] << 20, max_capsules=p["max_capsules"],
            speculative_tokens=p["speculative_tokens"], draft_vocab=p["draft_vocab"], vision_tower=p["vision_tower"],
            image_min_pixels=p["image.min_pixels"], image_max_pixels=p["image.max_pixels"]),
        discretiser=Discretiser(
            low=p["discretiser.low"], high=p["discretiser.high"], bins=p["discretiser.bins"],
            token_offset=p["discretiser.token_offset"], dims=p["discretiser.dims"],
            horizon=p["discretiser.horizon"]),
        sampling=_sampling(p),
        stream_chunk_tokens=p["stream_chunk_tokens"],
        observation_qos=QoSProfile(
            depth=p["qos.observation.depth"],
            reliability=(ReliabilityPolicy.RELIABLE if p["qos.observation.reliability"] == "reliable"
                         else ReliabilityPolicy.BEST_EFFORT),
            durability=(DurabilityPolicy.VOLATILE if p["qos.observation.durability"] == "volatile"
                        else DurabilityPolicy.TRANSIENT_LOCAL)),
        request_timeout_s=p["request_timeout_s"],
        diagnostics_period_s=p["diagnostics_period_s"],
        observation_queue={"max_bytes": p["observation_queue.max_bytes"],
                           "overload": p["observation_queue.overload"],
                           "max_group_bytes": p["observation_queue.max_group_bytes"]},
        image_limits={"max_raw_bytes": p["image.max_raw_bytes"],
                      "max_observation_pixels": p["image.max_observation_pixels"]},
        record_pixels=p["image.record_pixels"],
    )
