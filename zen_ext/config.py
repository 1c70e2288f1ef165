"""The ``"zen"`` section of a DeepSpeed (or ColossalAI) JSON config, as typed and validated config.

A top-level ``"zen"`` object in ``ds_config.json`` turns ZEN gradient synchronization on (DeepSpeed
ignores unknown top-level keys). Keys equal the dataclass field names below; every field has a
docstring with its unit, default and why. Validation runs before the first step:

* an unknown key raises ``ValueError`` listing the valid keys of its section;
* a wrong type raises ``TypeError`` and a value out of range ``ValueError``, both in the form
  ``zen.<field> (<value>) must <rule>`` (nested fields as ``zen.<section>.<field>``);
* an engine setting ZEN cannot serve (pipeline or sequence parallelism, MoE) raises ``NotImplementedError``
  naming what is supported (``check_deepspeed_settings``).

Each registered sparsifier (``zen_ext/compress/registry.py``) has its section at ``zen.<kind>``, parsed
by the config class it registered with; this module names none of them.

This module is engine-neutral: it reads plain dicts and imports neither DeepSpeed nor ColossalAI.
``python -m zen_ext.config_reference`` prints the Markdown reference of every key.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from ._keys import SECTION, near_miss_sections, unknown_keys_message, warn_near_miss_sections  # noqa: F401 (API)
from .compress import registered, spec_of
from .core.spardl import SparDLConfig
from .outer.config import OuterConfig

SUPPORTED_ZERO_STAGES = (0, 1, 2, 3)
MAX_BUCKET_CAP_MB = 2.0**20
"""Largest ``bucket_cap_mb`` (1 TiB): the cap in bytes must be a Python int (``bucket_cap_bytes``)."""

log = logging.getLogger(__name__)


class _Section:
    """Base of every section: validates on construction, so ``PlannerConfig(bandwidth_gbps=0)`` fails too."""

    _PATH: typing.ClassVar[str]

    def __post_init__(self) -> None:
        _validate(self, self._PATH)


@dataclass(kw_only=True)
class PlannerConfig(_Section):
    """Inputs of the ``"auto"`` scheme's cost model (paper §3.4, Eq. 1–2); ignored by other schemes."""
    _PATH = "zen.planner"

    bandwidth_gbps: Optional[float] = None
    """Per-rank link bandwidth the cost model assumes, in Gbit/s, > 0. null (default): measured at
    start by a short probe over the data-parallel group."""
    latency_us: Optional[float] = None
    """Per-message latency the cost model assumes, in microseconds, >= 0. null (default): measured
    at start with the bandwidth."""
    profile_steps: int = 3
    """Steps profiled (density, overlap) before the first choice, >= 1. Default 3. Profiling goes on
    until every candidate predicted within 1.5× of the best has run three times (measured, not only
    predicted; the first, cold run is not counted, the fastest of the other two ranks it)."""
    reprofile_every: int = 1000
    """Re-profile and re-choose every this many steps; 0 never re-profiles. Default 1000."""


@dataclass(kw_only=True)
class StatsConfig(_Section):
    """Per-step statistics and the end-of-run summary."""
    _PATH = "zen.stats"

    jsonl_path: str | None = None
    """Per-step JSONL file (bytes sent/received vs dense, density, scheme, times); one line per
    optimizer step, written by rank 0 with the group's totals. null: no file (the recipes default it
    to ``<output_dir>/zen_stats.jsonl``)."""
    summary: bool = True
    """Print a summary (bytes vs dense, scheme choices, time) on rank 0 at the end. Default true."""


@dataclass(kw_only=True)
class ZenConfig(_Section):
    """The ``"zen"`` section: which scheme synchronizes gradients and which sparsity feeds it."""
    _PATH = "zen"

    enabled: bool = True
    """Attach ZEN when the section is present. Default true; false keeps DeepSpeed's all-reduce."""
    scheme: str = "zen"
    """The synchronization scheme: ``"zen"`` (Balanced Parallelism with hash bitmap), ``"auto"``
    (the paper's planner picks per gradient among the lossless schemes), or any registered scheme
    (``dense``, ``agsparse``, ``sparcml``, ``omnireduce``, ``sparse_ps``, ``zen_coo``, and the lossy
    ``spardl``, which re-sparsifies and keeps residuals: ``zen.spardl``). Default zen."""
    seed: int = 0
    """Seed of the shared hash partition, >= 0; every rank must use the same (checked). Default 0."""
    pull_format: str = "auto"
    """Index encoding of ZEN's pull: ``"auto"`` (cheapest per partition), ``"bitmap"`` (hash
    bitmap), ``"coo"``, ``"dense"``. Default auto."""
    exchange_impl: str = "p2p"
    """Transport of variable-size exchanges: ``"p2p"`` (one ``batch_isend_irecv`` per exchange,
    NCCL-safe; 1.3–2.2× faster than a2a at 16–64 MiB per rank on 1 Gbit/s links) or ``"a2a"`` (one
    ``all_to_all_single`` with split sizes). Every rank must use the same (checked). Default p2p."""
    async_sync: bool = False
    """DDP hook: synchronize buckets on a communication thread while the backward pass goes on;
    DeepSpeed: pipeline the ZEN buckets of each engine bucket on that thread (compress bucket k + 1
    while k is on the wire; without node sharding or a TP group), and with ZeRO-1/2
    ``overlap_comm`` hand it whole IPG buckets, reduced and copied into the gradient partition
    while the backward pass fills the other IPG buffer. Results bitwise equal to the
    blocking path; false synchronizes in turn on the training thread. Default false: on the 2-core
    emulated lab the DDP hook measured 0.93-1.04x the blocking step time (the thread competes with
    autograd for the cores), and its CUDA stream path has not run on a GPU yet; turn it on where
    communication dominates and measure (benchmarks/cluster/bench_overlap.py)."""
    bucket_cap_mb: float = 128.0
    """Gradients are synchronized in buckets of at most this many MB (the paper's 128 MB DDP
    buckets); DeepSpeed hands up to 5e8 elements at once, so buckets are re-cut. > 0. Default 128."""
    hierarchical: Union[bool, str] = "auto"
    """Multi-GPU nodes (paper §4): dense reduce-scatter inside a node, ZEN across nodes on each
    shard, all-gather inside the node. ``"auto"``: on when every data-parallel group spans several
    nodes with the same number (> 1) of ranks on each, decided from every rank's host name (gathered
    once at start; ``ZEN_EXT_HOST`` overrides it), else flat ZEN with one log line saying why; true
    forces it (an error naming what is supported if it cannot apply); false never. Default auto."""
    spardl: SparDLConfig = field(default_factory=SparDLConfig)
    """Options of the SparDL scheme (see the ``zen.spardl`` table; ``core/spardl.py``)."""
    outer: OuterConfig = field(default_factory=OuterConfig)
    """Local steps and a sparse outer synchronization instead of a per-step one (see the ``zen.outer``
    table; ``zen_ext/outer/``, docs/outer.md). Off by default."""
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    """Cost-model inputs of ``scheme: "auto"`` (see the ``zen.planner`` table)."""
    stats: StatsConfig = field(default_factory=StatsConfig)
    """Statistics output (see the ``zen.stats`` table)."""
    sparsifier_sections: dict = field(default_factory=dict, metadata={"internal": True})
    """Every registered sparsifier's ``zen.<kind>`` section, by kind, in the registry's order, parsed
    with the config class it registered (an absent section: that class's defaults). Not a JSON key
    itself: the sections sit at ``zen.<kind>``; read one as ``cfg.<kind>`` or ``cfg.section(kind)``."""

    # --- construction ---------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, section: dict | None) -> "ZenConfig":
        """Build and validate from the ``"zen"`` section (a plain dict; None gives the defaults).

        Raises:
            ValueError: unknown key (lists the valid ones) or a value out of range.
            TypeError: a value of the wrong type.
        """
        if section is None:
            section = {}
        return _from_dict(cls, section, "zen")

    @classmethod
    def from_json_section(cls, section: Any) -> "ZenConfig":
        """Build from the ``"zen"`` value of a JSON run config (DeepSpeed or ColossalAI).

        Unlike ``from_dict``, ``null`` is refused: in a file, ``"zen": null`` reads as "no ZEN" to
        some and "the defaults" to others, so the config must say which.

        Raises:
            TypeError: ``section`` is ``null`` or not a JSON object.
            ValueError: see ``from_dict``.
        """
        if section is None:
            raise TypeError('zen (None) must be a JSON object (dict): write "zen": {} for the defaults, or '
                            '"zen": {"enabled": false} (or no "zen" key) to keep the engine\'s all-reduce')
        return _from_dict(cls, section, "zen")

    @classmethod
    def from_ds_config(cls, ds_config: "str | os.PathLike | dict") -> "ZenConfig":
        """Read the ``"zen"`` section of a DeepSpeed config (a path or a dict) and check the engine
        settings it must coexist with. A config without the section gives ``enabled=False``.

        Raises:
            ValueError, TypeError: see ``from_dict``.
            NotImplementedError: ZeRO-3 or pipeline parallelism with an enabled section.
        """
        ds = load_json_config(ds_config)
        if SECTION not in ds:
            warn_near_miss_sections(ds)
            return cls(enabled=False)
        cfg = cls.from_json_section(ds["zen"])
        if cfg.enabled:
            check_deepspeed_settings(ds)
        return cfg

    def to_dict(self) -> dict:
        """The section as a JSON-ready dict (round-trips through ``from_dict``)."""
        out = dataclasses.asdict(self)
        out.update(out.pop("sparsifier_sections"))  # each at zen.<kind>
        return out

    # --- the sparsifier sections ----------------------------------------------------------------------
    def __getattr__(self, name: str):
        """``cfg.<kind>``: the section of a registered sparsifier (``section``)."""
        sections = self.__dict__.get("sparsifier_sections")
        if sections is None or name.startswith("_"):
            raise AttributeError(name)
        if name in sections:
            return sections[name]
        if any(s.kind == name for s in registered()):  # registered after this config was built
            return self.section(name)
        raise AttributeError(f"{type(self).__name__} has no attribute or sparsifier section {name!r}")

    def section(self, kind: str):
        """The ``zen.<kind>`` section of the registered sparsifier ``kind`` (its defaults where the
        sparsifier was registered after this config was built).

        Raises:
            ValueError: ``kind`` is not registered (the registered kinds are listed).
        """
        if kind in self.sparsifier_sections:
            return self.sparsifier_sections[kind]
        return spec_of(kind).parse(None)

    def sections(self) -> dict:
        """The enabled sparsifier sections, by kind (for ``classify_parameters`` and the Synchronizer)."""
        return {k: v for k, v in self.sparsifier_sections.items() if v.enabled}

    def sections_line(self) -> str:
        """Which sparsifiers are on, for summaries: ``"natural=on dgc=off"`` (the registry's order)."""
        return " ".join(f"{k}={'on' if v.enabled else 'off'}" for k, v in self.sparsifier_sections.items())

    def with_section(self, kind: str, section) -> "ZenConfig":
        """A copy with ``zen.<kind>`` replaced by ``section`` (validated as when parsed)."""
        return dataclasses.replace(self, sparsifier_sections={**self.sparsifier_sections, kind: section})

    def resolve_defaults(self, optimizer, *, quiet: bool = False) -> "tuple[ZenConfig, str]":
        """Decide the fields the enabled sparsifiers leave null until zen attaches to an engine
        (``Sparsifier.resolve_defaults``: DGC's momentum correction, from ``optimizer``, the engine's,
        or None).

        Returns:
            ``(config, note)``: the config (a copy when a field was decided) and, for the start-up
            line, ``"<kind> <what was decided>"`` per sparsifier that decided something, joined by
            ``" | "`` ("" for nothing).
        """
        cfg, notes = self, []
        for spec in registered():
            section = cfg.section(spec.kind)
            if not section.enabled:
                continue
            decided, note = spec.cls.resolve_defaults(section, optimizer, quiet=quiet)
            if decided is not section:
                cfg = cfg.with_section(spec.kind, decided)
            if note:
                notes.append(f"{spec.kind} {note}")
        return cfg, " | ".join(notes)

    # --- what the config builds -----------------------------------------------------------------------
    def scheme_options(self) -> dict:
        """Constructor options of ``scheme``: the planner fields for ``"auto"``, ``zen.spardl``'s for
        SparDL, and ``seed`` / ``pull_format`` for schemes whose constructor takes them."""
        from .core.registry import scheme_class

        accepted = set(inspect.signature(scheme_class(self.scheme).__init__).parameters) - {"self"}
        opts = {"seed": self.seed, "pull_format": self.pull_format, **dataclasses.asdict(self.spardl)}
        if self.scheme == "auto":
            opts.update(dataclasses.asdict(self.planner))
        return {k: v for k, v in opts.items() if k in accepted}

    def build_scheme(self):
        """The configured SyncScheme instance."""
        from .core.registry import build_scheme

        return build_scheme(self.scheme, **self.scheme_options())

    def build_reduce_scatter(self):
        """The reduce-scatter form of ``scheme`` for sharded engines (ZeRO-2 reduce_scatter, ZeRO-3,
        FSDP2): zen/zen_coo → zen, dense → dense, auto → auto; NotImplementedError for the rest."""
        from .core.reduce_scatter import reduce_scatter_of

        return reduce_scatter_of(self.build_scheme())

    @property
    def bucket_cap_bytes(self) -> int:
        return int(self.bucket_cap_mb * 2**20)


# --- loading ------------------------------------------------------------------------------------------
def load_json_config(config: "str | os.PathLike | dict") -> dict:
    """A DeepSpeed config as a dict: a dict is returned as is, a path is read as JSON (or HJSON, as
    DeepSpeed accepts, when ``hjson`` is installed)."""
    if isinstance(config, dict):
        return config
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"ds_config ({config!r}) must be a path or a dict")
    with open(config) as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        try:
            import hjson
        except ImportError:
            raise exc from None
        return hjson.loads(text)


def check_deepspeed_settings(ds: dict) -> None:
    """Refuse DeepSpeed settings ZEN cannot serve, naming what is supported.

    ZEN replaces the data-parallel all-reduce of ZeRO 0/1/2 (optionally with AutoTP tensor
    parallelism) and the reduce-scatter of ZeRO-2 (``reduce_scatter: true``) and ZeRO-3
    (``engines/deepspeed_zero3.py``); pipeline parallelism reduces per stage through another path.

    Raises:
        NotImplementedError: a ZeRO stage above 3, pipeline or sequence parallelism.
    """
    zero = ds.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise TypeError(f"zero_optimization ({zero!r}) must be a JSON object (dict)")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int):
        raise TypeError(f"zero_optimization.stage ({stage!r}) must be an integer (one of "
                        f"{list(SUPPORTED_ZERO_STAGES)} with zen)")
    if stage not in SUPPORTED_ZERO_STAGES:
        raise NotImplementedError(
            f"zen supports zero_optimization.stage in {list(SUPPORTED_ZERO_STAGES)}, got stage {stage!r}")
    pipe = ds.get("pipeline") or {}
    stages = pipe.get("stages", 1) if isinstance(pipe, dict) else 1
    if isinstance(stages, bool) or not isinstance(stages, int):
        raise TypeError(f"pipeline.stages ({stages!r}) must be an integer")
    if stages > 1:
        raise NotImplementedError(
            f"zen supports data parallelism and AutoTP tensor + data parallelism, not pipeline "
            f"parallelism (pipeline.stages = {stages}); remove \"zen\" or run without pipeline stages")
    sp = ds.get("sequence_parallel_size", 1)
    if isinstance(sp, bool) or not isinstance(sp, int):
        raise TypeError(f"sequence_parallel_size ({sp!r}) must be an integer")
    if sp > 1:
        raise NotImplementedError(
            f"zen supports data parallelism and AutoTP tensor + data parallelism, not sequence "
            f"parallelism (sequence_parallel_size = {sp})")


# --- validation ---------------------------------------------------------------------------------------
def _parse_sparsifier_section(spec, data, path: str):
    """A ``zen.<kind>`` section from the JSON: a JSON object, every float finite (what only the JSON
    text shows), then the sparsifier's own config class parses and validates it."""
    if not isinstance(data, dict):
        raise TypeError(f"{path} ({data!r}) must be a JSON object (dict)")
    for name, value in data.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise _range_error(f"{path}.{name}", value, "be a finite number")
    return spec.parse(data)


def _from_dict(cls, data, path: str):
    if not isinstance(data, dict):
        raise TypeError(f"{path} ({data!r}) must be a JSON object (dict)")
    names = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("internal")]
    kwargs = {}
    if cls is ZenConfig:
        # zen.<kind> of every registered sparsifier: parsed by its own config class.
        specs = registered()
        names += [s.kind for s in specs]
        kwargs["sparsifier_sections"] = {s.kind: _parse_sparsifier_section(s, data[s.kind], f"{path}.{s.kind}")
                                         for s in specs if s.kind in data}
        data = {k: v for k, v in data.items() if k not in kwargs["sparsifier_sections"]}
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ValueError(unknown_keys_message(path, unknown, names))
    hints = typing.get_type_hints(cls)
    for name, value in data.items():
        if dataclasses.is_dataclass(hints[name]):
            value = _from_dict(hints[name], value, f"{path}.{name}")
        kwargs[name] = value
    return cls(**kwargs)  # __post_init__ validates


def _type_error(path: str, value: Any, what: str) -> TypeError:
    return TypeError(f"{path} ({value!r}) must be {what}")


def _check_type(path: str, value: Any, hint) -> Any:
    """Type-check one field; ints are accepted where a float is expected."""
    origin = typing.get_origin(hint)
    if origin is Union or origin is types.UnionType:
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        if bool in args and str in args:  # hierarchical
            if isinstance(value, (bool, str)):
                return value
            raise _type_error(path, value, 'true, false or "auto"')
        (inner,) = [a for a in args if a is not type(None)]
        if value is None:
            raise _type_error(path, value, "a number")
        return _check_type(path, value, inner)
    if hint is bool:
        if not isinstance(value, bool):
            raise _type_error(path, value, "a bool (true or false)")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _type_error(path, value, "an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _type_error(path, value, "a number")
        if not math.isfinite(value):  # JSON parsers accept NaN and Infinity
            raise _range_error(path, value, "be a finite number")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise _type_error(path, value, "a string")
        return value
    if hint is dict:  # ZenConfig.sparsifier_sections: each value is parsed by its sparsifier's config class
        if not isinstance(value, dict):
            raise _type_error(path, value, "a dict")
        return value
    if dataclasses.is_dataclass(hint):
        if isinstance(value, dict):
            return _from_dict(hint, value, path)
        if not isinstance(value, hint):
            raise _type_error(path, value, f"a {hint.__name__} or a JSON object")
        return value
    raise AssertionError(f"unhandled config type {hint} for {path}")


def _range_error(path: str, value: Any, rule: str) -> ValueError:
    return ValueError(f"{path} ({value!r}) must {rule}")


def _validate(obj, path: str) -> None:
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        setattr(obj, f.name, _check_type(f"{path}.{f.name}", getattr(obj, f.name), hints[f.name]))
    _RULES[type(obj)](obj, path)


def _rules_zen(c: ZenConfig, p: str) -> None:
    from .comm.torch_dist import EXCHANGE_IMPLS
    from .core.registry import available_schemes
    from .core.zen_wire import PULL_FORMATS

    schemes = available_schemes()
    if c.scheme not in schemes:
        raise _range_error(f"{p}.scheme", c.scheme, f"be one of {schemes}")
    if c.seed < 0:
        raise _range_error(f"{p}.seed", c.seed, "be >= 0")
    if c.pull_format not in PULL_FORMATS:
        raise _range_error(f"{p}.pull_format", c.pull_format, f"be one of {list(PULL_FORMATS)}")
    if c.exchange_impl not in EXCHANGE_IMPLS:
        raise _range_error(f"{p}.exchange_impl", c.exchange_impl, f"be one of {list(EXCHANGE_IMPLS)}")
    if not 0 < c.bucket_cap_mb <= MAX_BUCKET_CAP_MB:
        raise _range_error(f"{p}.bucket_cap_mb", c.bucket_cap_mb, f"be in (0, {int(MAX_BUCKET_CAP_MB)}]")
    if isinstance(c.hierarchical, str) and c.hierarchical != "auto":
        raise _range_error(f"{p}.hierarchical", c.hierarchical, 'be true, false or "auto"')
    if c.outer.enabled:
        from .core.registry import scheme_class

        if not scheme_class(c.scheme).lossless:  # the outer sum must equal a dense sum of the picks
            raise _range_error(f"{p}.scheme", c.scheme, "be a lossless scheme when zen.outer is enabled")
        cls = scheme_class(c.scheme)
        if c.outer.value_bits is not None and not (cls.carries_low_bits and (
                cls.counts_contributors or c.outer.average == "mean")):  # the same rule as outer/average.plan
            raise _range_error(f"{p}.outer.value_bits", c.outer.value_bits, f"be unset with zen.scheme ({c.scheme!r}): "
                               f"only ZEN schemes carry the outer picks in low bits (zen, zen_coo)")
    # Every registered kind's section, in the registry's order: an absent one is its defaults, and one
    # built in code (a dict) becomes its config class.
    given = dict(c.sparsifier_sections)
    for kind in given:
        spec_of(kind)  # an unregistered kind: ValueError listing the registered ones
    c.sparsifier_sections = {s.kind: s.parse(given.get(s.kind)) for s in registered()}


def _rules_planner(c: PlannerConfig, p: str) -> None:
    if c.bandwidth_gbps is not None and not c.bandwidth_gbps > 0:
        raise _range_error(f"{p}.bandwidth_gbps", c.bandwidth_gbps, "be > 0")
    if c.latency_us is not None and not c.latency_us >= 0:
        raise _range_error(f"{p}.latency_us", c.latency_us, "be >= 0")
    if c.profile_steps < 1:
        raise _range_error(f"{p}.profile_steps", c.profile_steps, "be >= 1")
    if c.reprofile_every < 0:
        raise _range_error(f"{p}.reprofile_every", c.reprofile_every, "be >= 0 (0: never)")


def _rules_stats(c: StatsConfig, p: str) -> None:
    if c.jsonl_path is not None and not c.jsonl_path:
        raise _range_error(f"{p}.jsonl_path", c.jsonl_path, "be a non-empty path or null")


_RULES = {ZenConfig: _rules_zen, PlannerConfig: _rules_planner, StatsConfig: _rules_stats}
