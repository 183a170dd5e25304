"""One generation request (`vidray.inference.request.GenerationRequest`): one rule set, applied by `vidray generate`
(`check_generate_args`) and by the HTTP Videos API (the real `VideoJobService` behind `build_api`, fake stages, no
Ray) with the same text; frozen; kept by the job store and read back as it was; handed to the denoiser as-is."""

from __future__ import annotations

import dataclasses

import pytest

from tests.unit.test_serve_limits import TOKEN_A, _wait_for, serve_maker
from vidray.generate import GenerateArgumentError, check_generate_args
from vidray.inference.request import (
    MAX_NUM_INFERENCE_STEPS,
    STORED_IMAGE,
    GenerationRequest,
    GenerationRequestError,
)
from vidray.serve.jobs import JobStore

REQUEST = dict(prompt="a red fox", num_frames=9, height=64, width=48, num_inference_steps=2, guidance_scale=1.0,
               seed=0, fps=8.0)

# (vidray generate's keyword, its value, the HTTP field's text, the request field): one bad input, both ways.
BAD_INPUTS = [
    ("prompt", "   ", "   ", "prompt"),
    ("prompt", "\u200b", "\u200b", "prompt"),  # a zero-width space only: blank to both
    ("seed", -1, "-1", "seed"),
    ("seed", 2**63, str(2**63), "seed"),
    ("num_inference_steps", 0, "0", "num_inference_steps"),
    ("num_inference_steps", MAX_NUM_INFERENCE_STEPS + 1, str(MAX_NUM_INFERENCE_STEPS + 1), "num_inference_steps"),
    ("guidance_scale", 0.5, "0.5", "guidance_scale"),
]


@pytest.fixture
def http(tiny_serve_model_dir, tmp_path):
    """(service, TestClient as alice): the real `VideoJobService` on the tiny model, its steps capped as
    `vidray generate` caps them (MAX_NUM_INFERENCE_STEPS), fake stages recording what the denoiser receives."""
    with serve_maker(tiny_serve_model_dir, tmp_path / "serve", headers={"Authorization": f"Bearer {TOKEN_A}"}) as make:
        service, client, stages = make(limits={"max_num_inference_steps": MAX_NUM_INFERENCE_STEPS})
        yield service, client, stages


@pytest.mark.parametrize(("keyword", "value", "text", "field"), BAD_INPUTS,
                         ids=[f"{k}={t!r}" for k, _, t, _ in BAD_INPUTS])
def test_vidray_generate_and_the_http_api_refuse_a_bad_input_with_the_same_message(
        tiny_serve_model_dir, tmp_path, http, keyword, value, text, field):
    _, client, _ = http
    with pytest.raises(GenerateArgumentError) as err:
        check_generate_args(tiny_serve_model_dir, **{"prompt": "a red fox", keyword: value},
                            output=tmp_path / "out.mp4")
    flag = "--" + field.replace("_", "-")
    cli = str(err.value)
    assert cli.startswith(f"{flag} ") and ";" not in cli, cli  # the one problem, named by its flag

    response = client.post("/v1/videos", json={"prompt": "a red fox", field: text})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field
    assert error["message"].startswith(f"{field} ")
    assert error["message"].removeprefix(f"{field} ") == cli.removeprefix(f"{flag} ")  # one rule, one text

    with pytest.raises(GenerationRequestError) as direct:  # and the request itself says it, with its names
        GenerationRequest(**{**REQUEST, field: value})
    assert [p.message() for p in direct.value.problems] == [error["message"]]


def test_a_good_request_is_the_same_request_from_the_command_line_and_from_http(tiny_serve_model_dir, tmp_path, http):
    service, client, stages = http
    _, from_cli = check_generate_args(tiny_serve_model_dir, "a red fox", tmp_path / "out.mp4", num_inference_steps=2,
                                      guidance_scale=3.0, seed=7, fps=8.0, bucket="9x64x48")
    response = client.post("/v1/videos", json={"prompt": "a red fox", "num_inference_steps": 2,
                                                "guidance_scale": 3.0, "seed": 7, "size": "48x64", "num_frames": 9})
    assert response.status_code == 200, response.text
    video_id = response.json()["id"]
    stored = service.store.get(video_id).request  # what the store kept, read back
    assert stored == from_cli
    _wait_for(lambda: service.store.get(video_id).status == "completed", what=f"{video_id} completed")
    assert stages.requests == [stored]  # the denoiser got the request itself, not a dict of its numbers
    assert type(stages.requests[0]) is GenerationRequest


def test_the_request_is_frozen():
    request = GenerationRequest(**REQUEST)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.seed = 1  # type: ignore[misc]
    assert dataclasses.replace(request, seed=1).seed == 1 and request.seed == 0


def test_the_job_store_keeps_the_request_and_reads_old_records(tmp_path):
    store = JobStore(tmp_path)
    request = GenerationRequest(**{**REQUEST, "negative_prompt": "blurry", "guidance_scale": 6.0, "seed": 2**63 - 1,
                                   "image": STORED_IMAGE}, family="easyanimate")
    job = store.create(model="m", prompt=request.prompt, size="48x64", seconds="1.125", params=request.to_dict(),
                       input_reference=b"\x89PNG not decoded here", input_suffix=".png")
    assert store.get(job.id).request == request

    # A record of before the type: its numbers alone, the prompt and the image beside them.
    old = {"num_frames": 9, "width": 48, "height": 64, "seed": 3, "num_inference_steps": 2, "guidance_scale": 1.0,
           "negative_prompt": "", "fps": 8.0, "input_reference": {"size": "40x30", "resized_to": "48x64"}}
    job = store.create(model="m", prompt="an old fox", size="48x64", seconds="1.125", params=old)
    assert store.get(job.id).request == GenerationRequest(**{**REQUEST, "prompt": "an old fox", "seed": 3})

    with pytest.raises(ValueError, match="version 2 is newer than this vidray reads"):
        GenerationRequest.from_dict({**request.to_dict(), "version": 2})


def test_the_bucket_is_checked_against_the_family_card():
    with pytest.raises(GenerationRequestError, match=r"bucket 8x64x48 cannot be made by the easyanimate model: "
                                                     r".*num_frames must be 1 or k\*4\+1"):
        GenerationRequest(**{**REQUEST, "num_frames": 8}, family="easyanimate")
    GenerationRequest(**{**REQUEST, "num_frames": 8})  # no family: sides and frames need only be positive
    with pytest.raises(GenerationRequestError, match="last_image needs image"):
        GenerationRequest(**REQUEST, last_image="last.png")


def test_every_broken_rule_is_listed_at_once_in_field_order():
    with pytest.raises(GenerationRequestError) as err:
        GenerationRequest(**{**REQUEST, "prompt": "", "num_inference_steps": 0, "fps": 0.0, "seed": -1})
    assert [p.field for p in err.value.problems] == ["prompt", "num_inference_steps", "seed", "fps"]
    assert str(err.value).count("; ") == 3 and "\n" not in str(err.value)  # one line
