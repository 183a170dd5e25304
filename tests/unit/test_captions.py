"""Captions longer than the text encoder's window (`model.max_sequence_length`): counted exactly as
`encode_prompts` tokenizes them, and reported by `prepare` (summary + report.json) and `train` (driver line)."""

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from vidray.config import DataConfig, ModelConfig, job_config_from_dict  # noqa: E402
from vidray.data.captions import shards_caption_truncation  # noqa: E402
from vidray.data.ingest import prepare_data  # noqa: E402
from vidray.models.text_encoder import (  # noqa: E402
    build_text_encoder,
    build_tokenizer,
    caption_truncation,
    count_prompt_tokens,
    encode_prompts,
)

EDGE_CLIP = Path(__file__).resolve().parents[1] / "data" / "edge" / "h264_8bit_320x240.mp4"
LONG_CAPTION = (  # the last entry of ../shared/data/edge/metadata.json (its README: "a caption of about 76 tokens")
    "a cinematic slow dolly shot of a hiker standing at the top of a mountain at golden hour, wind moving the tall "
    "grass, clouds drifting behind snowy peaks, warm light on the face, a small dog running around the hiker's "
    "boots, birds circling overhead, long shadows stretching across the ridge while the camera slowly pushes in"
)
SHORT_CAPTION = "a test card"
LONG_TOKENS = 68  # [CLS] + 66 word pieces + [SEP] with MiniLM's (BERT uncased) tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(ModelConfig())


def test_token_counts_equal_the_attention_mask_of_encode_prompts(tokenizer):
    text_encoder, encoder_tokenizer = build_text_encoder("tiny_random", seed=0)
    prompts = [LONG_CAPTION, SHORT_CAPTION, "", "Émigré café — naïve résumé"]
    counts = count_prompt_tokens(tokenizer, prompts)
    assert counts[0] == LONG_TOKENS and counts[2] == 2  # an empty prompt is [CLS] [SEP]
    for max_sequence_length in (128, 32, 4):
        _, mask = encode_prompts(text_encoder, encoder_tokenizer, prompts, max_sequence_length=max_sequence_length)
        assert mask.sum(dim=1).tolist() == [min(n, max_sequence_length) for n in counts], max_sequence_length


def test_edge_long_caption_is_reported_cut_by_36_tokens_at_max_sequence_length_32(tokenizer):
    stats = caption_truncation(tokenizer, [SHORT_CAPTION, LONG_CAPTION, SHORT_CAPTION], 32)
    assert (stats.num_captions, stats.num_truncated, stats.max_tokens_over, stats.total_tokens_over) == (3, 1, 36, 36)
    assert stats.to_dict() == {
        "num": 1, "num_captions": 3, "max_tokens_over": 36, "mean_tokens_over": 36.0, "total_tokens_over": 36,
        "max_sequence_length": 32,
    }
    text = str(stats)
    assert "1 of 3 captions" in text and "max_sequence_length=32" in text and "up to 36 tokens dropped" in text
    # Two cut captions: max and mean differ.
    two = caption_truncation(tokenizer, [LONG_CAPTION, LONG_CAPTION + " and a dragon"], 32)
    assert (two.num_truncated, two.max_tokens_over, two.total_tokens_over) == (2, 39, 75)
    assert two.mean_tokens_over == 37.5
    # A window that holds every caption: nothing reported as cut.
    fits = caption_truncation(tokenizer, [SHORT_CAPTION, LONG_CAPTION], LONG_TOKENS)
    assert fits.num_truncated == 0 and "all 2 captions fit" in str(fits)
    with pytest.raises(ValueError, match="max_sequence_length must be >= 1"):
        caption_truncation(tokenizer, [SHORT_CAPTION], 0)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The edge clip twice (long and short caption) prepared with the job's model section (limit 32 tokens)."""
    root = tmp_path_factory.mktemp("captions")
    source = root / "metadata.json"
    source.write_text(json.dumps([
        {"file_path": str(EDGE_CLIP), "text": LONG_CAPTION, "type": "video"},
        {"file_path": str(EDGE_CLIP), "text": SHORT_CAPTION, "type": "video"},
        {"file_path": str(root / "missing.mp4"), "text": LONG_CAPTION + " skipped", "type": "video"},
    ]))
    data = DataConfig(source=str(source), shards_dir=str(root / "shards"), buckets=[[9, 64, 64]], fps=8.0)
    model = ModelConfig(max_sequence_length=32)
    return data, model, prepare_data(data, model, progress=None)


def test_prepare_reports_cut_captions_of_kept_clips_in_summary_and_report_json(prepared):
    data, _, summary = prepared
    assert summary.num_kept == 2 and summary.num_skipped == 1
    stats = summary.captions_truncated
    # The skipped file's caption is not counted.
    assert (stats.num_captions, stats.num_truncated, stats.max_tokens_over) == (2, 1, 36)
    # Named per kept file: training counts per clip (a file cut into several clips counts several times), and the
    # two counts side by side read as a disagreement (a new user's trial: "3 of 22 captions", then "10 of 30").
    assert "1 of 2 kept files' captions are longer than model.max_sequence_length=32 tokens" in str(summary)
    report_path = next(Path(data.shards_dir).rglob("report.json"))
    report = json.loads(report_path.read_text())
    assert report["captions_truncated"] == {
        "num": 1, "num_captions": 2, "max_tokens_over": 36, "mean_tokens_over": 36.0, "total_tokens_over": 36,
        "max_sequence_length": 32,
    }


def test_prepare_without_a_model_section_reports_no_caption_counts(tmp_path):
    source = tmp_path / "metadata.json"
    source.write_text(json.dumps([{"file_path": str(EDGE_CLIP), "text": LONG_CAPTION, "type": "video"}]))
    data = DataConfig(source=str(source), shards_dir=str(tmp_path / "shards"), buckets=[[9, 64, 64]], fps=8.0)
    summary = prepare_data(data, progress=None)
    assert summary.num_kept == 1 and summary.captions_truncated is None
    assert "captions_truncated" not in json.loads(next(Path(data.shards_dir).rglob("report.json")).read_text())


def test_shards_caption_column_gives_the_same_counts_as_prepare(prepared):
    data, model, summary = prepared
    assert shards_caption_truncation(data.shards_dir, model) == summary.captions_truncated
    wider = ModelConfig(max_sequence_length=64)
    stats = shards_caption_truncation(data.shards_dir, wider)
    assert (stats.num_truncated, stats.max_tokens_over, stats.max_sequence_length) == (1, 4, 64)


class _RayNotStarted(Exception):
    pass


def test_train_prints_the_caption_line_on_the_driver_before_ray_starts(prepared, tmp_path, monkeypatch, capsys):
    import vidray.runtime
    from vidray.train.trainer import run_training

    data, _, _ = prepared

    def probe(*args, **kwargs):  # stands in for Ray: the test ends where Ray would start
        raise _RayNotStarted

    monkeypatch.setattr(vidray.runtime, "init_ray", probe)
    job = job_config_from_dict({
        "name": "captions", "model": {"text_encoder": "tiny_random", "max_sequence_length": 32},
        "data": {"source": data.source, "shards_dir": data.shards_dir, "buckets": [[9, 64, 64]], "fps": 8.0},
        "storage": {"path": str(tmp_path / "runs")}, "scaling": {"num_workers": 1},
    })
    with pytest.raises(_RayNotStarted):
        run_training(job)
    lines = [line for line in capsys.readouterr().out.splitlines() if "captions" in line]
    assert lines == [
        "[vidray] captions: 1 of 2 clips' captions are longer than model.max_sequence_length=32 tokens and are cut: up to 36 "
        "tokens dropped (mean 36.0); only their first 32 tokens (special tokens included) reach the model; raise "
        "model.max_sequence_length or shorten the captions"
    ]
