"""Content-aware shards (`vidray.data.grouping`, `prepare(group_by_caption=...)`): equal-size groups of similar
captions, one bucket per shard, and a sample table that still matches what was written."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from vidray.buckets import Bucket
from vidray.data.grouping import CaptionEmbedder, balanced_groups
from vidray.data.index import load_sample_index
from vidray.data.ingest import prepare
from vidray.data.shards import read_index, read_report
from vidray.data.video import write_mp4

BUCKETS = [[9, 64, 64], [1, 64, 64]]
FPS = 8.0
CATS = ["a cat sleeping on a sofa", "a kitten playing with a ball of yarn", "a cat chasing a mouse in the kitchen",
        "a fluffy cat licking its paw"]
CARS = ["a red sports car racing on a highway", "a truck driving through the desert",
        "cars stuck in traffic in a city", "a vintage car parked by the road"]


def _clusters(centres: list[float], size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(len(centres) * size, 8) float32 points around (c, 0, ..., 0) for each centre, rows shuffled; and each
    row's cluster."""
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(len(centres)), size)
    points = rng.normal(0, 0.3, (len(labels), 8))
    points[:, 0] += np.asarray(centres)[labels]
    order = rng.permutation(len(labels))
    return points[order].astype(np.float32), labels[order]


# --- balanced_groups ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_rows", "group_size", "sizes"), [
    (64, 8, [8] * 8), (67, 8, [8] * 8 + [3]), (40, 8, [8] * 5), (5, 8, [5]), (1, 1, [1]), (0, 4, []),
])
def test_balanced_groups_have_group_size_rows_the_last_the_remainder_and_hold_every_row_once(num_rows, group_size,
                                                                                             sizes):
    embeddings = np.random.default_rng(0).normal(size=(num_rows, 16)).astype(np.float32)
    groups = balanced_groups(embeddings, group_size)
    assert [len(g) for g in groups] == sizes
    assert sorted(np.concatenate(groups).tolist()) == list(range(num_rows)) if groups else num_rows == 0
    assert all(np.array_equal(g, np.sort(g)) for g in groups)  # rows of a group in source order


def test_balanced_groups_put_two_obvious_clusters_into_separate_groups():
    embeddings, labels = _clusters([-5.0, 5.0], size=16)
    groups = balanced_groups(embeddings, 16)
    assert len(groups) == 2
    assert [set(labels[g].tolist()) for g in groups] in ([{0}, {1}], [{1}, {0}])


def test_balanced_groups_separate_four_clusters_and_keep_neighbours_adjacent():
    embeddings, labels = _clusters([0.0, 10.0, 20.0, 30.0], size=8, seed=1)
    groups = balanced_groups(embeddings, 8)
    group_labels = [set(labels[g].tolist()) for g in groups]
    assert all(len(s) == 1 for s in group_labels)
    order = [s.pop() for s in group_labels]
    assert order in ([0, 1, 2, 3], [3, 2, 1, 0])  # leaves in tree order: consecutive groups are similar


def test_balanced_groups_are_deterministic():
    embeddings = np.random.default_rng(3).normal(size=(200, 32)).astype(np.float32)
    first = balanced_groups(embeddings, 16)
    again = balanced_groups(embeddings.copy(), 16)
    assert [g.tolist() for g in first] == [g.tolist() for g in again]
    ties = np.ones((10, 4), np.float32)  # identical rows: row order decides, every time
    assert [g.tolist() for g in balanced_groups(ties, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_balanced_groups_reject_bad_input_naming_it():
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        balanced_groups(np.zeros((4, 2)), 0)
    with pytest.raises(ValueError, match=r"must be \(N, D\)"):
        balanced_groups(np.zeros(4), 2)
    with pytest.raises(ValueError, match="NaN or inf"):
        balanced_groups(np.array([[0.0], [np.nan]]), 1)


# --- caption embeddings ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedder():
    return CaptionEmbedder()


def test_caption_embeddings_are_unit_vectors_that_group_captions_by_topic(embedder):
    captions = [c for pair in zip(CATS, CARS) for c in pair]  # interleaved: cat, car, cat, car, ...
    embeddings = embedder(captions)
    assert embeddings.shape == (8, 384) and embeddings.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)
    groups = balanced_groups(embeddings, 4)
    topics = [{"cat" if captions[i] in CATS else "car" for i in g} for g in groups]
    assert sorted(map(sorted, topics)) == [["car"], ["cat"]]
    assert embedder([]).shape == (0, 384)


# --- prepare writes one bucket per shard, similar captions together ----------------------------------------------


def _check_table_matches_shards(shards_dir):
    """Every sample of the sample table is at its (shard, row) with its id and bucket; every shard one bucket."""
    index = read_index(shards_dir)
    table = load_sample_index(shards_dir)
    shards = [pq.read_table(shards_dir / entry["file"], columns=["sample_id", "num_frames", "height", "width",
                                                                 "caption"]).to_pylist()
              for entry in index["shards"]]
    assert len(table) == sum(len(s) for s in shards) == index["num_samples"]
    assert table.shard.tolist() == sorted(table.shard.tolist())  # rows in shard order
    for i in range(len(table)):
        row = shards[table.shard[i]][table.row[i]]
        assert row["sample_id"] == table.sample_id[i].decode()
        assert Bucket(row["num_frames"], row["height"], row["width"]) == table.buckets[table.bucket_id[i]]
    for rows in shards:
        assert len({(r["num_frames"], r["height"], r["width"]) for r in rows}) == 1
    return shards


def test_prepare_of_the_samples_writes_one_bucket_per_shard_and_a_matching_sample_table(samples_dir, tmp_path):
    grouped = prepare(samples_dir / "metadata.json", tmp_path / "grouped", BUCKETS, FPS, samples_per_shard=2,
                      progress=None)
    shards = _check_table_matches_shards(tmp_path / "grouped")
    # 5 clips of 9x64x64 in shards of 2, 2 and the remainder 1; the image alone in its own shard.
    assert sorted((len(rows), rows[0]["num_frames"]) for rows in shards) == [(1, 1), (1, 9), (2, 9), (2, 9)]
    assert grouped.num_shards == 4 and "4 shard(s) of one bucket and similar captions each" in str(grouped)
    assert read_report(tmp_path / "grouped")["shards_grouped_by"] == "bucket and caption"
    plain = prepare(samples_dir / "metadata.json", tmp_path / "plain", BUCKETS, FPS, samples_per_shard=2,
                    progress=None, group_by_caption=False)
    _check_table_matches_shards(tmp_path / "plain")
    assert plain.num_shards == 4 and read_report(tmp_path / "plain")["shards_grouped_by"] == "bucket"
    ids = {s.decode() for s in load_sample_index(tmp_path / "plain").sample_id}
    assert {s.decode() for s in load_sample_index(tmp_path / "grouped").sample_id} == ids  # ids do not change


def test_prepare_groups_similar_captions_into_the_same_shards(tmp_path, samples_dir):
    clip = write_mp4(np.full((9, 64, 64, 3), 128, np.uint8), tmp_path / "clip.mp4", fps=FPS)
    captions = [c for pair in zip(CATS, CARS) for c in pair]  # source order alternates the topics
    entries = [{"file_path": clip.name, "text": text, "type": "video"} for text in captions]
    entries.append({"file_path": str(samples_dir / "animatediff_sailboat_painting.png"), "text": "a sailboat",
                    "type": "image"})
    (tmp_path / "meta.json").write_text(json.dumps(entries))
    summary = prepare(tmp_path / "meta.json", tmp_path / "shards", BUCKETS, FPS, samples_per_shard=4, progress=None)
    assert summary.num_samples == 9
    shards = _check_table_matches_shards(tmp_path / "shards")
    topics = sorted(sorted({"cat" if r["caption"] in CATS else "car" if r["caption"] in CARS else "image"
                            for r in rows}) for rows in shards)
    assert topics == [["car"], ["cat"], ["image"]]
    plain = prepare(tmp_path / "meta.json", tmp_path / "plain", BUCKETS, FPS, samples_per_shard=4, progress=None,
                    group_by_caption=False)
    assert plain.num_shards == 3
    mixed = _check_table_matches_shards(tmp_path / "plain")
    assert {r["caption"] in CATS for r in mixed[0]} == {True, False}  # source order mixes the topics
