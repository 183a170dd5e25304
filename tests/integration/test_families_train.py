"""Wan 2.2 A14B's image-to-video layout through Ray Train: its two experts trained in one run as two worker groups
(what `vidray.train.local.train_in_process` refuses: the groups form from Ray Train's workers), each clip
conditioned on its own first frame through the data plane, resumed exactly, exported as the stock
`WanImageToVideoPipeline` with `transformer` and `transformer_2`. Every other family and image-to-video config
runs the same checks in process: `tests/unit/test_families_train.py`, whose `check_image_to_video_run` this calls."""

from __future__ import annotations

import pytest

from vidray.train.trainer import run_training

from tests.unit.test_families_train import check_image_to_video_run

pytestmark = pytest.mark.integration


def test_two_expert_groups_train_on_their_clips_first_frames_resume_exactly_and_export_the_stock_pipeline(
        local_ray, shards_dir, tmp_path):
    # The config's default layout (two worker groups, DDP); FSDP within each group trains on a labeled cluster in
    # test_placement_cluster.py, and both experts on every worker (layout shared) in tests/unit (test_wan*.py).
    check_image_to_video_run("wan_i2v_tiny.yaml", "WanImageToVideoPipeline", run_training, shards_dir, tmp_path)
