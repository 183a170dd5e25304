"""Stage placement by node label: which nodes a stage may run on, checked on the driver before Ray reserves anything.

A job's `placement` section maps a stage to a Ray label selector (`{label key: selector value}`, all keys must
hold); the stage's resources stay where they are configured (`scaling.*` for the DiT trainers, `data.loader_cpus`
for the decode operator). Stages placed today:

- `dit`: the Ray Train workers (`ScalingConfig(label_selector=...)`);
- `decode`: each rank's Ray Data fetch + decode operator (`map_batches(label_selector=...)`,
  `vidray.data.pipeline.RankLoader`);
- `vae`, `text`: each rank's encode actors (`vidray.data.encode.EncodeStage`, `map_batches(label_selector=...)`),
  with their resources in `placement.vae|text.num_cpus|num_gpus`;
- `expert_high`, `expert_low` (`model.experts.layout: groups`): the two halves of the Ray Train workers, one per
  expert, placed by `placement.dit`'s selector merged with `model.experts.high|low.label_selector` (one selector
  per worker: `ScalingConfig(label_selector=[...])`, `vidray.train.trainer.build_trainer_configs`).

Selector values use Ray's syntax (Ray 2.60, `ray._private.label_utils.LABEL_SELECTOR_REGEX`): `"v"` (the label
equals v), `"!v"` (it does not, or the node lacks the key), `"in(a,b)"`, `"!in(a,b)"`. Nodes get labels from
`ray start --labels "vidray.io/stage=vae"`, `Cluster.add_node(labels=...)`, or a cluster YAML's
`available_node_types.<type>.labels`.

Ray leaves a task or actor whose selector no node satisfies PENDING forever, with no error
(../shared/NOTES.md), so `resolve_placement` decides on the driver, from the nodes alive now:

- a selector whose keys no node carries, on a local cluster that vidray started itself and whose nodes carry no
  labels at all (a laptop), is dropped with a printed line: the stage runs wherever Ray puts it, same config;
- on a cluster that has labeled nodes or was joined by address (`RAY_ADDRESS`, `ray job submit`), the same
  selector raises `PlacementError`: a production cluster that forgot its labels must not train unplaced;
- otherwise a selector that no alive node satisfies, or whose nodes lack the stage's resources, raises
  `PlacementError` naming the stage, the selector and the labels that exist;
- with an autoscaler the check cannot see the labels of node types not yet started (Ray 2.60's autoscaler
  state, `autoscaler_pb2.NodeGroupConfig`, carries no labels), so an unmatched selector is kept with a warning
  and the worker group's bounded start-up (`vidray.runtime.WORKER_GROUP_START_RETRIES`) ends the wait.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Iterable

from vidray.errors import UserError

STAGES = ("dit", "decode", "vae", "text")
"""The stages a `placement` section may name, in the order they are checked."""

EXPERT_STAGES = {"expert_high": "high", "expert_low": "low"}
"""The worker groups of `model.experts.layout: groups` ({stage: side of `model.experts`}): each half of the DiT
trainers, placed by `placement.dit`'s selector merged with `model.experts.<side>.label_selector`."""

_VALUE = r"[a-zA-Z0-9]([a-zA-Z0-9_.-]{0,61}[a-zA-Z0-9])?"
_SELECTOR_RE = re.compile(rf"^(?P<neg>!)?(?:in\((?P<set>{_VALUE}(?:, ?{_VALUE})*)\)|(?P<one>{_VALUE}))$")
"""Ray 2.60's selector-value syntax (`ray._private.label_utils.LABEL_SELECTOR_REGEX`, with `in` its only
operator), with named groups to evaluate it."""


class PlacementError(UserError):
    """Stages whose label selector no node of the cluster satisfies (or whose nodes cannot hold the stage). The
    message names all of them; `problems` holds one whole message per stage (what `vidray doctor` prints as one
    FAIL line each)."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or [message]

    def __reduce__(self):
        return (type(self), (str(self), self.problems))


@dataclass(frozen=True)
class Condition:
    """One `key: value` of a selector: the node's label `key` must (or, `negated`, must not) be in `values`."""

    key: str
    values: frozenset[str]
    negated: bool

    def holds(self, labels: dict[str, str]) -> bool:
        """True if a node with these labels satisfies it (a missing key satisfies only a negated condition)."""
        present = labels.get(self.key) in self.values
        return not present if self.negated else present


def parse_selector(selector: dict[str, str], *, setting: str = "label_selector") -> list[Condition]:
    """The conditions of `{key: selector value}`.

    Raises ValueError naming `setting`, the key and the syntax when a value is not Ray's selector syntax or a
    key is empty (so a config fails at load, before Ray is started).
    """
    conditions = []
    for key, value in selector.items():
        if not isinstance(key, str) or not key.strip():
            raise ValueError(f"{setting}: label keys must be non-empty strings, got {key!r}")
        match = _SELECTOR_RE.match(str(value)) if isinstance(value, str) else None
        if match is None:
            raise ValueError(f"{setting}: {key}: {value!r} is not a label selector value; use 'v', '!v', "
                             "'in(a,b)' or '!in(a,b)' (letters, digits, '-', '_', '.', at most 63 characters)")
        values = match["set"].replace(" ", "").split(",") if match["set"] else [match["one"]]
        conditions.append(Condition(key, frozenset(values), bool(match["neg"])))
    return conditions


def merge_selectors(base: dict[str, str], extra: dict[str, str], *, setting: str) -> dict[str, str]:
    """`base` with `extra`'s keys added (a node must satisfy both). Raises ValueError naming `setting` when a key is
    in both with different values (Ray takes one value per key, so the two could not both hold)."""
    clash = sorted(k for k in set(base) & set(extra) if base[k] != extra[k])
    if clash:
        key = clash[0]
        raise ValueError(f"{setting}: {key}: {extra[key]!r} clashes with placement.dit.label_selector's {key}: "
                         f"{base[key]!r} (a node must satisfy both): give the key one value, or drop it from one of "
                         "them")
    return {**base, **extra}


def expert_selectors(job: Any) -> dict[str, dict[str, str]]:
    """{"expert_high": selector, "expert_low": selector} of a job with `model.experts.layout: groups`: each
    `placement.dit.label_selector` merged with `model.experts.high|low.label_selector` (`merge_selectors`), empty
    when neither sets one; {} for any other job."""
    experts = getattr(job.model, "experts", None)
    if experts is None or experts.layout != "groups":
        return {}
    return {stage: merge_selectors(job.placement.dit.label_selector, getattr(experts, side).label_selector,
                                   setting=f"model.experts.{side}.label_selector")
            for stage, side in EXPERT_STAGES.items()}


def expert_of_ranks(placement: dict[str, dict[str, str]], node_labels: list[dict[str, str]]) -> list[str]:
    """The expert, "high" or "low", of each world rank of a `model.experts.layout: groups` run, given the labels of
    the node each rank runs on (`node_labels[rank]`, gathered from every rank) and the resolved `placement`
    ({stage: selector}: `expert_high` / `expert_low`, else `dit`, else anywhere).

    Ray Train places bundle i by the i-th selector of `ScalingConfig(label_selector=[...])` but numbers world
    ranks by node and GPU id, not by bundle, so rank r < W/2 need not be a high-noise bundle. A rank whose node
    only the high (low) selector admits is that expert's; the ranks both admit fill the high-noise half in rank
    order, then the low one. The same on every rank (a pure function of the gathered labels). Raises ValueError
    for an odd rank count, a rank whose node neither selector admits, or more than half of the ranks on nodes only
    one expert admits (a placement Ray would not have made)."""
    num_ranks = len(node_labels)
    if num_ranks < 2 or num_ranks % 2:
        raise ValueError(f"model.experts.layout: groups needs an even number of ranks >= 2, got {num_ranks}")
    half = num_ranks // 2
    dit = placement.get("dit") or {}
    high_selector, low_selector = placement.get("expert_high") or dit, placement.get("expert_low") or dit
    sides: list[str | None] = []
    for rank, labels in enumerate(node_labels):
        high, low = selector_matches(high_selector, labels), selector_matches(low_selector, labels)
        if not (high or low):
            raise ValueError(f"rank {rank}'s node ({labels}) satisfies neither expert's selector (high "
                             f"{high_selector}, low {low_selector})")
        sides.append(None if high and low else "high" if high else "low")
    for side in ("high", "low"):
        if sides.count(side) > half:
            raise ValueError(f"{sides.count(side)} of {num_ranks} ranks run on nodes only the {side}-noise expert's "
                             f"selector admits ({high_selector if side == 'high' else low_selector}): at most "
                             f"{half} can train it")
    missing_high = half - sides.count("high")
    for rank, side in enumerate(sides):
        if side is None:
            sides[rank] = "high" if missing_high > 0 else "low"
            missing_high -= sides[rank] == "high"
    return [str(side) for side in sides]


def selector_matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """True if a node with `labels` satisfies every condition of `selector` (an empty selector: every node)."""
    return all(c.holds(labels) for c in parse_selector(selector))


@dataclass(frozen=True)
class NodeInfo:
    """What the placement check needs of a node: its id, labels and total logical resources."""

    node_id: str
    labels: dict[str, str]
    resources: dict[str, float]

    @classmethod
    def from_ray(cls, node: dict[str, Any]) -> "NodeInfo":
        """From one entry of `ray.nodes()` (keys NodeID, Labels, Resources)."""
        return cls(str(node.get("NodeID", "")), dict(node.get("Labels") or {}),
                   {k: float(v) for k, v in (node.get("Resources") or {}).items()})


def alive_nodes() -> list[NodeInfo]:
    """The alive nodes of the connected Ray cluster (`ray.nodes()`); Ray must be initialised."""
    import ray  # heavy: ray

    return [NodeInfo.from_ray(n) for n in ray.nodes() if n.get("Alive")]


def joined_by_address() -> bool:
    """True when this process joined a running Ray cluster (`RAY_ADDRESS` set, as `ray job submit` and `vidray
    train` on a cluster do, or `ray.init(address=...)`) rather than starting a local one itself."""
    if os.environ.get("RAY_ADDRESS"):
        return True
    try:
        from ray._private import worker  # heavy: ray; the node this process started (head) or connected to (not head)
    except ImportError:
        return False
    node = getattr(worker, "_global_node", None)
    return node is not None and not getattr(node, "head", True)


def has_user_labels(nodes: Iterable[NodeInfo]) -> bool:
    """True if any node carries a label of its own (keys outside Ray's built-in `ray.io/` prefix)."""
    return any(not key.startswith("ray.io/") for node in nodes for key in node.labels)


def _describe_labels(nodes: Iterable[NodeInfo]) -> str:
    seen: dict[str, int] = {}
    for node in nodes:
        shown = {k: v for k, v in node.labels.items() if k != "ray.io/node-id"}
        text = ", ".join(f"{k}={v}" for k, v in sorted(shown.items())) or "no labels"
        seen[text] = seen.get(text, 0) + 1
    return "; ".join(f"{n} node(s) with {text}" for text, n in sorted(seen.items()))


def stage_needs(job: Any, stage: str) -> tuple[dict[str, float], int]:
    """(logical resources of one unit of `stage`, units that must fit at least): the DiT trainers need
    `scaling.cpus_per_worker` CPUs (and 1 GPU with `scaling.use_gpu`) each, `scaling.num_workers` (its min)
    of them; a decode operator needs `data.loader_cpus` CPUs, one per trainer; a vae / text encode actor its
    `placement.<stage>.num_cpus` CPUs (and `num_gpus`, `memory` bytes), one per trainer; an expert's group
    (`expert_high`, `expert_low`) half of the DiT trainers."""
    if stage == "dit":
        need = {"CPU": float(job.scaling.cpus_per_worker)}
        if job.scaling.use_gpu:
            need["GPU"] = 1.0
        return need, job.scaling.min_workers
    if stage in EXPERT_STAGES:
        need, _ = stage_needs(job, "dit")
        return need, job.scaling.max_workers // 2  # layout groups: a fixed, even worker count (vidray.config)
    if stage == "decode":
        return {"CPU": float(job.data.loader_cpus)}, job.scaling.min_workers
    if stage in ("vae", "text"):
        cfg = getattr(job.placement, stage)
        need = {"CPU": float(cfg.num_cpus)}
        if cfg.num_gpus:
            need["GPU"] = float(cfg.num_gpus)
        if cfg.memory:
            need["memory"] = float(cfg.memory)
        return need, job.scaling.min_workers
    raise ValueError(f"unknown stage {stage!r}; stages: {', '.join((*STAGES, *EXPERT_STAGES))}")


def _units_that_fit(nodes: Iterable[NodeInfo], need: dict[str, float]) -> int:
    total = 0
    for node in nodes:
        per_node = [int((node.resources.get(r, 0.0) + 1e-9) // amount) for r, amount in need.items() if amount > 0]
        total += min(per_node) if per_node else 1 << 30
    return total


def _stage_selectors(job: Any) -> list[tuple[str, dict[str, str], str, str]]:
    """(stage, selector, the setting as shown, the key to remove to run it anywhere) of each placed stage, in the
    order they are checked: `STAGES`, then the expert groups of `model.experts.layout: groups` (`EXPERT_STAGES`)
    whose own selector is set."""
    out = [(stage, dict(getattr(job.placement, stage).label_selector),
            f"placement.{stage}.label_selector={dict(getattr(job.placement, stage).label_selector)}",
            f"placement.{stage}") for stage in STAGES]
    dit = dict(job.placement.dit.label_selector)
    for stage, merged in expert_selectors(job).items():
        side = EXPERT_STAGES[stage]
        own = dict(getattr(job.model.experts, side).label_selector)
        if not own:
            continue  # placement.dit's selector alone: the dit stage's outcome is the expert's
        setting = f"model.experts.{side}.label_selector={own}" + (
            f" (with placement.dit.label_selector: {merged})" if dit else "")
        out.append((stage, merged, setting, f"model.experts.{side}.label_selector"))
    return out


def resolve_placement(
    job: Any, nodes: list[NodeInfo], *, autoscaler: bool = False, joined: bool | None = None
) -> dict[str, dict[str, str]]:
    """{stage: label selector to pass to Ray} for the stages `job.placement` places, given the cluster's alive
    `nodes`; stages without a selector, or whose selector is dropped (module docstring), are absent.

    With `model.experts.layout: groups` two more stages, `expert_high` and `expert_low` (`EXPERT_STAGES`): each
    half of the DiT trainers, placed by `placement.dit`'s selector merged with `model.experts.high|low`'s
    (`expert_selectors`), needing `scaling.num_workers // 2` DiT workers' resources; present when that merged
    selector is non-empty and kept. An expert without a selector of its own follows the `dit` stage's outcome.

    `joined`: whether the cluster was joined by address rather than started here (None: `joined_by_address()`).
    A selector whose keys no node carries is dropped with a printed line only on a cluster started here whose
    nodes carry no labels of their own (a laptop); on a joined or labeled cluster it raises PlacementError.

    Counts each node's total resources for the stage alone (a node shared by two stages is counted for each: a
    necessary check, not a packing). Raises PlacementError naming the stage, its selector, what it needs and the
    labels the cluster's nodes carry: when no alive node satisfies the selector, or its nodes hold fewer units of
    the stage than it needs (`stage_needs`). With `autoscaler=True` these become printed warnings.
    """
    resolved: dict[str, dict[str, str]] = {}
    problems: list[tuple[str, str]] = []  # (key to remove, problem): all reported at once, so all can be fixed at once
    for stage, selector, setting, key in _stage_selectors(job):
        if not selector:
            continue
        known_keys = {k for node in nodes for k in node.labels}
        if not autoscaler and not known_keys & set(selector):
            if joined is None:
                joined = joined_by_address()
            if joined or has_user_labels(nodes):
                where = "a cluster joined by address" if joined else "a cluster with labeled nodes"
                problems.append((key, f"no node carries the label key {' or '.join(sorted(selector))} that "
                                      f"{setting} needs ({where}: the {stage} stage would run unplaced)"))
                continue
            print(f"[vidray] {setting}: no node of the cluster has a label {' or '.join(sorted(selector))}, so "
                  f"the {stage} stage runs wherever Ray places it (a cluster without labels)", flush=True)
            continue
        matching = [n for n in nodes if selector_matches(selector, n.labels)]
        need, units = stage_needs(job, stage)
        fit = _units_that_fit(matching, need)
        problem = None
        if not matching:
            problem = f"no node satisfies {setting}"
        elif fit < units:
            problem = (f"the {len(matching)} node(s) satisfying {setting} hold {fit} of the {units} {stage} "
                       f"unit(s) of {need} that the job needs")
        if problem:
            if not autoscaler:
                problems.append((key, problem))
                continue
            print(f"[vidray] warning: {_placement_message([(key, problem)], nodes)}. The cluster has an "
                  "autoscaler whose node types' labels Ray does not report: the run waits for such a node, within "
                  "the worker group's start-up retries", flush=True)
        else:
            print(f"[vidray] {setting}: {len(matching)} of the cluster's {len(nodes)} node(s) satisfy it "
                  f"({fit} {stage} unit(s) fit)", flush=True)
        resolved[stage] = selector
    if problems:
        raise PlacementError(_placement_message(problems, nodes),
                             [_placement_message([one], nodes) for one in problems])
    if "dit" in resolved:  # an expert without a selector of its own goes where the dit stage goes
        groups = expert_selectors(job)
        for stage, side in EXPERT_STAGES.items():
            if stage in groups and not getattr(job.model.experts, side).label_selector:
                resolved[stage] = dict(resolved["dit"])
    return resolved


def _placement_message(problems: list[tuple[str, str]], nodes: list[NodeInfo]) -> str:
    """The stages' problems (each with the key to remove to run it anywhere), the labels the cluster's nodes carry,
    and the fixes."""
    stages = ", ".join(key for key, _ in problems)
    several = len(problems) > 1
    experts = [key.split(".")[2] for key, _ in problems if key.startswith("model.experts.")]
    example = f"vidray.io/expert={experts[0]}" if experts else "vidray.io/stage=..."
    return (f"{'; '.join(problem for _, problem in problems)}; the cluster's {len(nodes)} alive node(s): "
            f"{_describe_labels(nodes)}. Fix the selector{'s' if several else ''}, label nodes (`ray start --labels "
            f"{example}`, or the cluster YAML's available_node_types.<type>.labels), or remove {stages} "
            f"to run {'them' if several else 'it'} anywhere")
