"""`model.experts.layout` (issue 29): the config of one worker group per expert, its checks at load, the placement
check of each group's selector on a cluster's nodes, and the per-worker label selectors Ray Train gets."""

from __future__ import annotations

from pathlib import Path

import pytest

from vidray.config import ConfigError, diff_for_resume, load_job_config
from vidray.placement import NodeInfo, PlacementError, expert_of_ranks, resolve_placement, stage_needs

REPO = Path(__file__).resolve().parents[2]
HIGH = {"vidray.io/expert": "high"}
LOW = {"vidray.io/expert": "low"}
PLACED = ["model.experts.high.label_selector={vidray.io/expert: high}",
          "model.experts.low.label_selector={vidray.io/expert: low}"]


def job(*overrides: str):
    return load_job_config(None, ["model.family=wan", "model.experts={}", "scaling.num_workers=2",
                                  "scaling.cpus_per_worker=1", *overrides])


def node(name: str, cpus: float, **labels: str) -> NodeInfo:
    return NodeInfo(name, {"ray.io/node-id": name, **labels}, {"CPU": cpus})


CLUSTER = [node("head", 0), node("h1", 2, **{"vidray.io/expert": "high"}),
           node("l1", 2, **{"vidray.io/expert": "low"})]


# 1. The config.
def test_the_default_layout_is_one_group_per_expert_without_selectors():
    experts = job().model.experts
    assert experts.layout == "groups" and experts.high.label_selector == {} and experts.low.label_selector == {}
    shipped = load_job_config(REPO / "jobs/configs/wan_i2v_tiny.yaml")
    assert shipped.model.experts.layout == "groups" and shipped.scaling.num_workers == 2


def test_layout_and_the_experts_selectors_are_command_line_overrides():
    shared = job("model.experts.layout=shared")
    assert shared.model.experts.layout == "shared" and shared.model.experts.boundary_ratio == 0.9
    placed = job(*PLACED)
    assert (placed.model.experts.high.label_selector, placed.model.experts.low.label_selector) == (HIGH, LOW)
    # a section not in the YAML is created by the override, with the other keys at their defaults
    made = load_job_config(None, ["model.family=wan", "model.experts.layout=shared"])
    assert made.model.experts.layout == "shared" and made.model.experts.boundary_ratio == 0.9
    assert made.to_dict()["model"]["experts"]["high"] == {"label_selector": {}}


@pytest.mark.parametrize("overrides, message", [
    (["scaling.num_workers=3"], "got scaling.num_workers=3: set scaling.num_workers to an even number, or "
                                "model.experts.layout: shared"),
    (["scaling.num_workers=1"], "set scaling.num_workers to an even number, or model.experts.layout: shared"),
    (["scaling.num_workers=[2, 4]"], r"needs a fixed worker count .*\[2, 4\] \(elastic\)"),
    (["scaling.num_workers=[2, 2]"], r"needs a fixed worker count"),
    (["train.mixed_precision=fp16", "scaling.use_gpu=true"], "train.mixed_precision: fp16 with "
                                                             "model.experts.layout: groups is not supported"),
    (["scaling.strategy=hsdp", "scaling.shard_group_size=1"], r"hsdp is not supported with two experts: set "
                                                               r"scaling.strategy: fsdp"),
    (["model.experts.layout=shared", "scaling.strategy=fsdp"], r"layout: shared trains with scaling.strategy: ddp "
                                                                r"only \(every worker holds both"),
    (["model.experts.layout=shared", "model.experts.high.label_selector={vidray.io/expert: high}"],
     "model.experts.high.label_selector is set but model.experts.layout is shared"),
    (["placement.dit.label_selector={vidray.io/expert: gpu}",
      "model.experts.low.label_selector={vidray.io/expert: low}"],
     "model.experts.low.label_selector: vidray.io/expert: 'low' clashes with placement.dit.label_selector's"),
    (["model.experts.layout=both"], "bad choice for 'model.experts.layout'"),
    (["model.experts.high.label_selector={vidray.io/expert: '-x'}"], "is not a label selector value"),
])
def test_a_groups_run_that_cannot_be_split_in_two_is_refused_at_load_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        job(*overrides)
    assert "\n" not in str(err.value)


def test_the_shared_layout_keeps_todays_worker_counts_and_a_selector_may_repeat_the_dits():
    assert job("model.experts.layout=shared", "scaling.num_workers=3").scaling.num_workers == 3
    assert job("model.experts.layout=shared", "scaling.num_workers=[1, 3]").scaling.elastic
    same = job("placement.dit.label_selector={vidray.io/expert: high}", PLACED[0])  # same key, same value
    assert same.model.experts.high.label_selector == HIGH


def test_layout_and_selectors_are_fixed_for_the_run():
    saved = job().to_dict()
    for change in ("model.experts.layout=shared", PLACED[0]):
        assert list(diff_for_resume(saved, job(change)).fixed) == ["model.experts"]
    assert not diff_for_resume(saved, job()).fixed


# 2. The placement check.
def test_each_expert_group_is_checked_on_its_own_nodes_for_half_the_workers(capsys):
    placed = job(*PLACED)
    assert stage_needs(placed, "expert_high") == ({"CPU": 1.0}, 1)
    assert resolve_placement(placed, CLUSTER) == {"expert_high": HIGH, "expert_low": LOW}
    out = capsys.readouterr().out
    assert "model.experts.high.label_selector={'vidray.io/expert': 'high'}: 1 of the cluster's 3 node(s)" in out
    assert resolve_placement(job(), CLUSTER) == {}  # no selector anywhere: nothing to place
    assert resolve_placement(job("model.experts.layout=shared"), CLUSTER) == {}


def test_an_expert_selector_merges_with_the_dits_and_an_expert_without_one_follows_the_dit():
    cluster = [node("h", 2, **{"vidray.io/stage": "dit", "vidray.io/expert": "high"}),
               node("l", 2, **{"vidray.io/stage": "dit", "vidray.io/expert": "low"})]
    placed = job("placement.dit.label_selector={vidray.io/stage: dit}", PLACED[0])
    assert resolve_placement(placed, cluster) == {
        "dit": {"vidray.io/stage": "dit"}, "expert_high": {"vidray.io/stage": "dit", **HIGH},
        "expert_low": {"vidray.io/stage": "dit"}}


def test_an_expert_selector_no_node_satisfies_fails_before_anything_is_reserved():
    with pytest.raises(PlacementError, match=r"no node satisfies model.experts.high.label_selector="
                                             r"\{'vidray.io/expert': 'mid'\}.*or remove "
                                             r"model.experts.high.label_selector") as err:
        resolve_placement(job("model.experts.high.label_selector={vidray.io/expert: mid}", PLACED[1]), CLUSTER)
    assert len(err.value.problems) == 1
    assert "`ray start --labels vidray.io/expert=high`" in str(err.value)  # the label an expert's node needs
    # 4 workers: each expert's nodes must hold 2 of them (h1 has 2 CPUs: fits; a 1-CPU low node does not)
    small = [CLUSTER[1], node("l1", 1, **{"vidray.io/expert": "low"})]
    with pytest.raises(PlacementError, match=r"hold 1 of the 2 expert_low unit\(s\)"):
        resolve_placement(job(*PLACED, "scaling.num_workers=4"), small)


def test_an_expert_label_no_node_carries_is_dropped_on_a_laptop_and_refused_on_a_joined_cluster(capsys):
    laptop = [node("local", 8)]
    assert resolve_placement(job(*PLACED), laptop, joined=False) == {}
    assert "so the expert_high stage runs wherever Ray places it" in capsys.readouterr().out
    with pytest.raises(PlacementError, match="no node carries the label key vidray.io/expert that model.experts.high"):
        resolve_placement(job(*PLACED), laptop, joined=True)
    # an autoscaler may start such nodes later: kept, with a warning
    assert resolve_placement(job(*PLACED), laptop, autoscaler=True) == {"expert_high": HIGH, "expert_low": LOW}
    assert "warning: no node satisfies model.experts" in capsys.readouterr().out


# 3. Ray Train's per-worker selectors, and which rank trains which expert.
def test_ray_train_gets_one_selector_per_worker_high_then_low(tmp_path):
    from vidray.train.trainer import build_trainer_configs

    placed = job(*PLACED, "scaling.num_workers=4")
    scaling, _ = build_trainer_configs(placed, str(tmp_path), placement={"expert_high": HIGH, "expert_low": LOW})
    assert scaling.label_selector == [HIGH, HIGH, LOW, LOW]
    assert scaling._label_selector_per_worker(4) == [HIGH, HIGH, LOW, LOW]  # what Ray's controller hands the bundles
    only_high, _ = build_trainer_configs(placed, str(tmp_path), placement={"expert_high": HIGH})
    assert only_high.label_selector == [HIGH, HIGH, {}, {}]  # {}: anywhere (Ray's bundle selectors accept it)
    unplaced, _ = build_trainer_configs(placed, str(tmp_path), placement={})
    assert unplaced.label_selector is None
    shared, _ = build_trainer_configs(job("model.experts.layout=shared"), str(tmp_path),
                                      placement={"dit": {"vidray.io/stage": "dit"}})
    assert shared.label_selector == {"vidray.io/stage": "dit"}


def test_each_rank_learns_its_expert_from_its_nodes_labels_not_its_rank():
    placement = {"expert_high": HIGH, "expert_low": LOW}
    # Ray numbers ranks by node: the low node's workers may come first
    assert expert_of_ranks(placement, [LOW, LOW, HIGH, HIGH]) == ["low", "low", "high", "high"]
    # nodes both selectors admit fill the high-noise half first, in rank order
    assert expert_of_ranks({}, [{}, {}, {}, {}]) == ["high", "high", "low", "low"]
    assert expert_of_ranks(placement | {"expert_low": {}}, [{}, HIGH, HIGH, {}]) == ["low", "high", "high", "low"]
    with pytest.raises(ValueError, match="satisfies neither expert's selector"):
        expert_of_ranks(placement, [HIGH, {"vidray.io/expert": "mid"}])
    with pytest.raises(ValueError, match="at most 1 can train it"):
        expert_of_ranks(placement, [HIGH, HIGH])


def test_a_two_expert_run_saved_before_layout_existed_resumes_as_shared_only():
    saved = job().to_dict()
    saved["model"]["experts"] = {"boundary_ratio": 0.9}  # older vidray: every worker held both experts
    assert not diff_for_resume(saved, job("model.experts.layout=shared")).fixed
    refused = diff_for_resume(saved, job()).fixed_summary()
    assert refused == "model.experts.layout: 'shared' -> 'groups'"  # the entry that differs, not both sections
