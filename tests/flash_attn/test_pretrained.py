"""culmen.flash_attn.utils.pretrained.state_dict_from_pretrained: local folders (safetensors, sharded
safetensors, pytorch_model.bin, sharded .bin), hub names through huggingface_hub (a stand-in hub, and an
unreachable one), dtype / device conversion, errors; and a saved Hugging Face LLaMA loaded into
culmen's GPTLMHeadModel end to end."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers

from culmen.flash_attn.utils import pretrained
from culmen.flash_attn.utils.pretrained import state_dict_from_pretrained
from culmen.testing.tolerance import assert_close_tolerance


@pytest.fixture(autouse=True)
def _quiet_transformers():
    transformers.logging.set_verbosity_error()
    yield


def _tiny_llama(tie: bool = False) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=37, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def _assert_same(loaded: dict, expected: dict) -> None:
    assert set(loaded) == set(expected)
    for k, v in expected.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k


def _saved_tensors(model) -> dict:
    # tied models do not save lm_head.weight
    sd = model.state_dict()
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    return sd


def _write_bin_shards(folder, sd: dict, shards: int) -> None:
    names = sorted(sd)
    weight_map = {}
    for s in range(shards):
        file = f"pytorch_model-{s + 1:05d}-of-{shards:05d}.bin"
        part = {k: sd[k].clone() for k in names[s::shards]}
        torch.save(part, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("tie", [False, True])
def test_safetensors_folder(tmp_path, tie):
    model = _tiny_llama(tie)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    _assert_same(state_dict_from_pretrained(tmp_path), _saved_tensors(model))
    _assert_same(state_dict_from_pretrained(str(tmp_path)), _saved_tensors(model))


def test_sharded_safetensors_folder(tmp_path):
    model = _tiny_llama()
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    _assert_same(state_dict_from_pretrained(tmp_path), _saved_tensors(model))


def test_bin_and_sharded_bin_folders(tmp_path):
    model = _tiny_llama()
    sd = _saved_tensors(model)
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    single.mkdir()
    sharded.mkdir()
    torch.save(sd, single / "pytorch_model.bin")
    _write_bin_shards(sharded, sd, shards=3)
    _assert_same(state_dict_from_pretrained(single), sd)
    _assert_same(state_dict_from_pretrained(sharded), sd)


def test_safetensors_preferred_over_bin(tmp_path):
    model = _tiny_llama()
    model.save_pretrained(tmp_path)
    torch.save({"other": torch.zeros(3)}, tmp_path / "pytorch_model.bin")
    _assert_same(state_dict_from_pretrained(tmp_path), _saved_tensors(model))


def test_dtype_converts_floating_tensors_only(tmp_path):
    sd = {"w": torch.randn(5, 3), "b": torch.randn(3, dtype=torch.float64), "steps": torch.arange(4),
          "mask": torch.tensor([True, False])}
    torch.save(sd, tmp_path / "pytorch_model.bin")
    loaded = state_dict_from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded["w"].dtype == loaded["b"].dtype == torch.bfloat16
    assert torch.equal(loaded["w"], sd["w"].to(torch.bfloat16)) and torch.equal(loaded["b"], sd["b"].bfloat16())
    assert loaded["steps"].dtype == torch.int64 and torch.equal(loaded["steps"], sd["steps"])
    assert loaded["mask"].dtype == torch.bool and torch.equal(loaded["mask"], sd["mask"])
    as_fp32 = state_dict_from_pretrained(tmp_path, dtype=torch.float32)
    assert as_fp32["b"].dtype == torch.float32 and torch.equal(as_fp32["w"], sd["w"])


def test_device_argument(tmp_path):
    model = _tiny_llama()
    model.save_pretrained(tmp_path)
    on_cpu = state_dict_from_pretrained(tmp_path, device=torch.device("cpu"))
    assert all(v.device.type == "cpu" for v in on_cpu.values())
    on_meta = state_dict_from_pretrained(tmp_path, device="meta", dtype=torch.float16)
    assert all(v.device.type == "meta" and v.dtype == torch.float16 for v in on_meta.values())
    assert {k: v.shape for k, v in on_meta.items()} == {k: v.shape for k, v in on_cpu.items()}


def test_hub_names_resolve_through_huggingface_hub(tmp_path, monkeypatch):
    """A stand-in hub: repository id -> folder, each file fetched on demand like hf_hub_download."""
    model = _tiny_llama()
    repo = tmp_path / "hub" / "org--tiny"
    model.save_pretrained(repo, max_shard_size="20KB")
    fetched = []

    def fake_hub_file(repo_id, filename):
        if repo_id != "org/tiny":
            raise pretrained._HubUnavailable(f"Repository Not Found for {repo_id}")
        fetched.append(filename)
        path = repo / filename
        return str(path) if path.is_file() else None

    monkeypatch.setattr(pretrained, "_hub_file", fake_hub_file)
    _assert_same(state_dict_from_pretrained("org/tiny"), _saved_tensors(model))
    assert fetched[:2] == ["model.safetensors", "model.safetensors.index.json"]
    assert len(fetched) == 2 + len(list(repo.glob("model-*.safetensors")))
    with pytest.raises(OSError, match="not found on the Hugging Face hub"):
        state_dict_from_pretrained("org/missing")


def test_unreachable_hub_raises_oserror(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="org/not-cached.*offline or unreachable"):
        state_dict_from_pretrained("org/not-cached")


def test_offline_hub_uses_whichever_file_is_cached(tmp_path, monkeypatch):
    sd = _saved_tensors(_tiny_llama())
    torch.save(sd, tmp_path / "pytorch_model.bin")

    def cache_only(repo_id, filename):  # offline: only the .bin was downloaded before
        if filename == "pytorch_model.bin":
            return str(tmp_path / filename)
        raise pretrained._NotCached(f"{filename} is not cached")

    monkeypatch.setattr(pretrained, "_hub_file", cache_only)
    _assert_same(state_dict_from_pretrained("org/cached"), sd)


def test_errors(tmp_path):
    with pytest.raises(OSError, match="none of"):
        state_dict_from_pretrained(tmp_path)  # a folder without a checkpoint
    with pytest.raises(TypeError, match="model_name"):
        state_dict_from_pretrained(123)
    with pytest.raises(TypeError, match="dtype"):
        state_dict_from_pretrained(tmp_path, dtype="float16")


def test_saved_llama_loads_into_gpt_lm_head_model(tmp_path):
    from culmen.flash_attn.models.gpt import GPTLMHeadModel
    from culmen.flash_attn.models.llama import llama_config_to_gpt2_config, remap_state_dict_hf_llama

    model = _tiny_llama(tie=True)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    config = llama_config_to_gpt2_config(transformers.LlamaConfig.from_pretrained(tmp_path))
    gpt = GPTLMHeadModel(config).eval()
    gpt.load_state_dict(remap_state_dict_hf_llama(state_dict_from_pretrained(tmp_path), config), strict=True)
    ids = torch.randint(0, 37, (2, 9))
    with torch.no_grad():
        ref_hi = copy.deepcopy(model).double()(ids).logits
        assert_close_tolerance(gpt(ids).logits, ref_hi, model(ids).logits, name="logits")


@pytest.mark.gpu
def test_gpu_device_and_dtype(tmp_path):
    model = _tiny_llama()
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    for dtype in (None, torch.float32, torch.bfloat16):
        loaded = state_dict_from_pretrained(tmp_path, device="cuda", dtype=dtype)
        for k, v in _saved_tensors(model).items():
            assert loaded[k].is_cuda and loaded[k].dtype == (dtype or v.dtype)
            assert torch.equal(loaded[k].cpu(), v.to(dtype or v.dtype)), k
