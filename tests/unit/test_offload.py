"""Inference placement (`vidray.models.offload`) on tiny real models: each offload mode's hooks with the CPU as the
onload device give the frames of `none`; `model` offload holds one component (one Wan2.2 expert) at a time; storage
dtypes; the CUDA-only modes refused on CPU in one line; `vidray generate --storage-dtype/--offload`."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from vidray.cli import main  # noqa: E402
from vidray.config import ExpertsConfig, FlowConfig, MemoryConfig, ModelConfig, job_config_from_dict  # noqa: E402
from vidray.buckets import Bucket  # noqa: E402
from vidray.data.video import decode_mp4  # noqa: E402
from vidray.inference.sampler import generate_video  # noqa: E402
from vidray.errors import UserError  # noqa: E402
from vidray.generate import write_job_file  # noqa: E402
from vidray.models import get_family  # noqa: E402
from vidray.models.offload import (  # noqa: E402
    OFFLOAD_MODES,
    OneResidentHook,
    apply_inference_offload,
    compute_dtype,
    execution_device,
    offload_problem,
    prepare_for_inference,
    inference_dtypes,
)

FLOW = FlowConfig(shift=3.0)
BUCKET = Bucket(5, 32, 32)


def _build(family_name: str, **model):
    return get_family(family_name).build(ModelConfig(family=family_name, text_encoder="tiny_random", **model), seed=0)


def _frames(family_name: str, components, steps: int = 3) -> np.ndarray:
    with torch.inference_mode():
        return generate_video(get_family(family_name), components, ["a red ball"], BUCKET, flow=FLOW,
                              num_inference_steps=steps, max_sequence_length=16, seed=3)


def _placed(family_name: str, storage_dtype: str, mode: str, **model):
    """Components stored in `storage_dtype` and placed by `mode` with the CPU as the onload device (the hooks' logic
    without a GPU: `prepare_for_inference` refuses offload on CPU, so the storage dtype is applied through it with
    offload none and the mode's hooks after)."""
    components = _build(family_name, **model)
    prepare_for_inference(components, MemoryConfig(storage_dtype=storage_dtype), "cpu", family_name=family_name)
    if mode != "none":
        apply_inference_offload(components, mode, "cpu")
    return components


@pytest.mark.parametrize("family_name", ["easyanimate", "wan"])
def test_every_offload_mode_gives_the_frames_of_none(family_name):
    reference = _frames(family_name, _placed(family_name, "fp32", "none"))
    for mode in OFFLOAD_MODES[1:]:
        frames = _frames(family_name, _placed(family_name, "fp32", mode))
        np.testing.assert_array_equal(frames, reference, err_msg=mode)


def test_fp8_storage_under_every_offload_mode_gives_the_frames_of_fp8_without_offload():
    reference = _frames("wan", _placed("wan", "fp8", "none"))
    for mode in OFFLOAD_MODES[1:]:
        np.testing.assert_array_equal(_frames("wan", _placed("wan", "fp8", mode)), reference, err_msg=mode)


def test_the_cpu_default_changes_nothing_fp32_frames_as_before():
    plain = _build("easyanimate")
    reference = _frames("easyanimate", plain)  # never prepared: how sampling ran before
    components = _build("easyanimate")
    assert prepare_for_inference(components, MemoryConfig(), "cpu", family_name="easyanimate") == torch.float32
    assert {p.dtype for p in components.transformer.parameters()} == {torch.float32}
    np.testing.assert_array_equal(_frames("easyanimate", components), reference)


def test_storage_dtypes_store_and_compute_as_named():
    assert inference_dtypes("auto", "cpu") == (torch.float32, torch.float32)
    assert inference_dtypes("auto", "cuda") == (torch.bfloat16, torch.bfloat16)
    assert inference_dtypes("fp8", "cpu") == (torch.float8_e4m3fn, torch.bfloat16)
    with pytest.raises(ValueError, match="fp4"):
        inference_dtypes("fp4", "cpu")
    fp32, fp8 = _build("wan"), _placed("wan", "fp8", "none")
    weights = dict(fp8.transformer.named_parameters())
    linear = [n for n, m in fp8.transformer.named_modules() if isinstance(m, torch.nn.Linear) and "blocks" in n]
    assert linear and all(weights[f"{n}.weight"].dtype == torch.float8_e4m3fn for n in linear)
    assert compute_dtype(fp8.transformer) == torch.bfloat16
    assert compute_dtype(fp8.vae) == torch.float32  # Wan's VAE computes in fp32 (diffusers' Wan examples)
    assert compute_dtype(_placed("easyanimate", "bf16", "none").vae) == torch.bfloat16
    stored = sum(p.numel() * p.element_size() for p in fp8.transformer.parameters())
    full = sum(p.numel() * p.element_size() for p in fp32.transformer.parameters())
    assert stored < 0.5 * full
    # fp8 storage is a small quality cost on a random model, not noise: the frames stay close to fp32's
    diff = np.abs(_frames("wan", fp8).astype(int) - _frames("wan", fp32).astype(int))
    assert diff.mean() < 2.0


def _residency(components, hooks):
    """Record, at the end of each forward of a hooked component, which components are on the device (the VAE's
    `decode` is no forward: it is checked after sampling)."""
    seen = []
    for hook in hooks:
        hook.module.register_forward_hook(
            lambda module, args, output, hooks=hooks: seen.append((module, [h.module for h in hooks if h.resident])))
    return seen


def test_model_offload_holds_one_component_and_one_expert_at_a_time():
    components = _placed("wan", "fp32", "none", experts=ExpertsConfig(boundary_ratio=0.5))
    apply_inference_offload(components, "model", "cpu")
    experts = [components.transformer.transformer, components.transformer.transformer_2]
    hooks = experts[0]._hf_hook.group
    assert all(isinstance(h, OneResidentHook) for h in hooks)
    assert {id(h.module) for h in hooks} == {id(m) for m in (components.text_encoder, components.vae, *experts)}
    seen = _residency(components, hooks)
    _frames("wan", components, steps=4)
    called = [module for module, _ in seen]
    assert components.text_encoder in called and experts[0] in called and experts[1] in called
    for module, resident in seen:  # the module running is the only one on the device
        assert resident == [module], (type(module).__name__, [type(m).__name__ for m in resident])
    assert [h.module for h in hooks if h.resident] == [components.vae]  # the decode ran last
    assert execution_device(components.transformer) == torch.device("cpu")


def test_offload_modes_need_cuda_one_line_naming_the_mode_and_none():
    assert offload_problem("none", cuda=False) is None and offload_problem("group", cuda=True) is None
    for mode in OFFLOAD_MODES[1:]:
        problem = offload_problem(mode, cuda=False)
        assert "\n" not in problem and f"memory.offload: {mode}" in problem and "memory.offload: none" in problem
    with pytest.raises(UserError, match="memory.offload: sequential needs a CUDA GPU"):
        prepare_for_inference(_build("easyanimate"), MemoryConfig(offload="sequential"), "cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    family = get_family("easyanimate")
    out = family.save_pipeline(_build("easyanimate"), tmp_path_factory.mktemp("model") / "diffusers", FLOW)
    write_job_file(out, job_config_from_dict({
        "name": "offload", "model": {"text_encoder": "tiny_random", "max_sequence_length": 16},
        "data": {"buckets": [list(BUCKET)]}, "flow": {"shift": 3.0}}))
    return out


def test_cli_offload_on_cpu_exits_2_with_one_line_before_loading(model_dir, tmp_path, capsys, monkeypatch):
    import vidray.generate

    monkeypatch.setattr(vidray.generate, "load_model", lambda *a, **k: pytest.fail("weights were loaded"))
    code = main(["generate", "--model", str(model_dir), "--prompt", "a ball", "--output", str(tmp_path / "v.mp4"),
                 "--offload", "model"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--offload model needs a CUDA GPU" in err[0] and "--offload none" in err[0]
    assert main(["generate", "--model", str(model_dir), "--prompt", "a ball", "--output", str(tmp_path / "v.mp4"),
                 "--storage-dtype", "int4"]) == 2
    assert "--storage-dtype 'int4': give one of auto, fp32, bf16, fp8" in capsys.readouterr().err


def test_cli_storage_dtypes_write_close_videos(model_dir, tmp_path):
    videos = {}
    for dtype in ("fp32", "bf16", "fp8"):
        out = tmp_path / f"{dtype}.mp4"
        assert main(["generate", "--model", str(model_dir), "--prompt", "a ball", "--output", str(out),
                     "--num-inference-steps", "2", "--crf", "0", "--storage-dtype", dtype]) == 0
        videos[dtype] = decode_mp4(out.read_bytes()).astype(np.int16)
    assert videos["fp32"].shape == videos["fp8"].shape == (5, 32, 32, 3)
    for dtype in ("bf16", "fp8"):
        diff = np.abs(videos[dtype] - videos["fp32"])
        assert 0 < diff.mean() < 3.0, dtype  # computed in bf16 (not fp32's frames), close to them


def test_the_export_names_no_device_and_keeps_fp32_weights_so_one_folder_serves_on_either(tmp_path):
    # The same folder is sampled on CPU (fp32) and on a GPU (bf16 / fp8 chosen at load): export_pipeline records
    # neither a device nor an inference dtype, and the weights stay float32 as trained.
    import json

    from safetensors import safe_open

    from vidray.models.export import export_pipeline

    family = get_family("wan")
    out = export_pipeline(family, _build("wan"), tmp_path / "diffusers", FLOW)
    configs = [json.loads(path.read_text()) for path in out.glob("*/config.json")] + [
        json.loads((out / "model_index.json").read_text())]
    for config in configs:
        assert not {"device", "device_map", "torch_dtype"} & set(config), config
        assert config.get("dtype", "float32") == "float32"  # transformers records its weights' dtype
    for path in out.glob("*/*.safetensors"):
        with safe_open(str(path), "pt") as weights:
            assert {str(weights.get_slice(key).get_dtype()) for key in weights.keys()} == {"F32"}, path.parent.name


def test_validation_samples_per_the_jobs_memory_and_drops_offload_on_a_validator_without_gpu(caplog):
    from vidray.models.export import LoadedModel
    from vidray.train.validation import prepare_validation

    family = get_family("easyanimate")
    model = LoadedModel(family=family, components=_build("easyanimate"), flow=FLOW, max_sequence_length=16,
                        buckets=[BUCKET])
    with caplog.at_level("WARNING"):
        assert prepare_validation(model, MemoryConfig(storage_dtype="bf16", offload="model")) == torch.bfloat16
    assert "memory.offload: model applies on a GPU only" in caplog.text
    assert {p.dtype for p in model.components.transformer.parameters()} == {torch.bfloat16}
    assert not hasattr(model.components.transformer, "_hf_hook")  # no offload hooks on CPU


def test_group_offload_moves_the_text_encoder_off_the_device_while_the_transformer_runs():
    components = _placed("easyanimate", "fp32", "group")
    hooks = components.text_encoder._hf_hook.group
    assert [h.module for h in hooks] == [components.text_encoder, components.vae]
    seen = []
    components.transformer.register_forward_hook(
        lambda module, args, output: seen.append([h.module for h in hooks if h.resident]))
    _frames("easyanimate", components, steps=2)
    assert seen == [[], []]  # nothing else on the device during the two denoising steps
