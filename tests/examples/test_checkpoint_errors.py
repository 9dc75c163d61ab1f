"""A checkpoint either is the model its config.json describes, or examples.checkpoint refuses it, naming why.

Each case below corrupts a copy of one tiny random Qwen2 directory (saved by transformers) in one way and expects
a CheckpointError whose message names the file, the tensor or the config key. The command line reports the same
errors as one line on stderr.
"""

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from examples import checkpoint, generate  # noqa: E402
from tests.examples.test_models import make_hf  # noqa: E402

ST = "model.safetensors"
DOWN = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A valid directory: Qwen2 (q/k/v biases), 2 layers, untied head, a tokenizer."""
    path = tmp_path_factory.mktemp("good")
    make_hf("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=False), str(path))
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    tok.save(str(path / "tokenizer.json"))
    return path


def tensors(d):
    return safetensors_torch.load_file(str(d / ST))


def save(d, ts, name=ST):
    safetensors_torch.save_file(ts, str(d / name), metadata={"format": "pt"})


def config(d, **kw):
    c = json.loads((d / "config.json").read_text())
    c.update(kw)
    (d / "config.json").write_text(json.dumps(c))


def edit(d, fn):
    ts = tensors(d)
    fn(ts)
    save(d, ts)


def truncate(d, size):
    data = (d / ST).read_bytes()
    (d / ST).write_bytes(data[: size if size >= 0 else len(data) // 2])


def index(d, weight_map, raw=None):
    text = raw if raw is not None else json.dumps({"metadata": {}, **weight_map})
    (d / "model.safetensors.index.json").write_text(text)


def all_in(d):
    return {n: ST for n in tensors(d)}


def set_(ts, name, value):
    ts[name] = value


CASES = {  # name: (corrupt the directory, the error's message must match)
    "truncated": (lambda d: truncate(d, -1), r"model\.safetensors: unreadable safetensors"),
    "zero-byte": (lambda d: truncate(d, 0), r"model\.safetensors: unreadable safetensors"),
    "not-safetensors": (lambda d: (d / ST).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}"), "unreadable"),
    "no-weights": (lambda d: (d / ST).unlink(), r"no \*\.safetensors files"),
    "wrong-shape": (
        lambda d: config(d, num_key_value_heads=4),
        r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape",
    ),
    "missing-tensor": (lambda d: edit(d, lambda ts: ts.pop(DOWN)), rf"'{DOWN}' is missing"),
    "missing-head": (lambda d: edit(d, lambda ts: ts.pop("lm_head.weight")), r"'lm_head\.weight' is missing"),
    "extra-tensor": (
        lambda d: edit(d, lambda ts: set_(ts, "model.layers.0.mlp.extra.weight", torch.zeros(3))),
        r"1 tensors the model does not use: model\.layers\.0\.mlp\.extra\.weight",
    ),
    "duplicate-across-files": (
        lambda d: shutil.copy(d / ST, d / "model-stale.safetensors"),
        r"in both model-stale\.safetensors and model\.safetensors",
    ),
    "int8": (
        lambda d: edit(d, lambda ts: set_(ts, DOWN, ts[DOWN].to(torch.int8))),
        rf"'{DOWN}' is int8, not a float",
    ),
    "wrong-architecture": (
        lambda d: config(d, architectures=["LlamaForCausalLM"], model_type="llama"),
        r"LlamaForCausalLM has no q/k/v biases, but the weights have 'model\.layers\.0\.self_attn\.q_proj\.bias'",
    ),
    "moe-weights-labelled-dense": (
        lambda d: edit(
            d, lambda ts: set_(ts, "model.layers.0.mlp.experts.0.gate_proj.weight", ts[DOWN].T.contiguous())
        ),
        r"Qwen2ForCausalLM is dense, but the weights hold MoE experts \('model\.layers\.0\.mlp\.experts\.0",
    ),
    "unknown-architecture": (lambda d: config(d, architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel.*not supported"),
    "fewer-layers": (lambda d: config(d, num_hidden_layers=1), r"num_hidden_layers=1, the weights have layers 0\.\.1"),
    "more-layers": (lambda d: config(d, num_hidden_layers=3), r"num_hidden_layers=3, the weights have layers 0\.\.1"),
    "config-invalid-json": (lambda d: (d / "config.json").write_text("{"), r"config\.json: not valid JSON"),
    "config-not-an-object": (lambda d: (d / "config.json").write_text("[1]"), r"config\.json: a JSON list"),
    "config-missing-key": (
        lambda d: (d / "config.json").write_text(
            json.dumps({k: v for k, v in json.loads((d / "config.json").read_text()).items() if k != "hidden_size"})
        ),
        r"config\.json: key 'hidden_size' is missing",
    ),
    "config-bad-value": (
        lambda d: config(d, num_hidden_layers="two"),
        r"config\.json: num_hidden_layers='two' is not a positive integer",
    ),
    "config-bad-rope": (
        lambda d: config(d, rope_scaling={"rope_type": "llama3"}, rope_parameters=None),
        r"config\.json: rope parameters",
    ),
    "config-string-for-a-number": (
        lambda d: config(d, rms_norm_eps="1e-6"),
        r"config\.json: rms_norm_eps='1e-6' is not a finite number >= 0",
    ),
    "config-string-for-a-flag": (
        lambda d: config(d, tie_word_embeddings="false"),  # bool("false") is True: read, it tied the head
        r"config\.json: tie_word_embeddings='false' is not true or false",
    ),
    "config-heads-not-a-multiple-of-kv-heads": (
        lambda d: config(d, num_key_value_heads=3),
        r"config\.json: num_attention_heads=4 is not a multiple of num_key_value_heads=3",
    ),
    "config-two-ropes-that-disagree": (  # transformers >= 5's rope_parameters plus a legacy rope_scaling added
        lambda d: config(d, rope_scaling={"type": "linear", "factor": 4.0}),
        r"config\.json: rope_scaling \{'type': 'linear', 'factor': 4\.0\} and rope_parameters .* disagree",
    ),
    "index-invalid-json": (lambda d: index(d, {}, raw="{"), r"index\.json: not valid JSON"),
    "index-without-weight_map": (lambda d: index(d, {}), r"index\.json: no \"weight_map\""),
    "index-missing-shard": (
        lambda d: index(d, {"weight_map": {**all_in(d), DOWN: "model-00002-of-00002.safetensors"}}),
        r"model-00002-of-00002\.safetensors, which does not exist",
    ),
    "index-lies": (
        lambda d: index(d, {"weight_map": {**all_in(d), "model.layers.9.mlp.x.weight": ST}}),
        r"'model\.layers\.9\.mlp\.x\.weight' cannot be read|layers 0\.\.9",
    ),
    "nan-weight": (
        lambda d: edit(d, lambda ts: ts[DOWN].view(-1).__setitem__(5, float("nan"))),
        rf"non-finite values \(NaN or inf\) in {DOWN}",
    ),
    "inf-weight": (
        lambda d: edit(d, lambda ts: ts["model.norm.weight"].__setitem__(0, float("inf"))),
        r"non-finite values \(NaN or inf\) in model\.norm\.weight",
    ),
    "tied-but-different-head": (
        lambda d: config(d, tie_word_embeddings=True),
        r"ties lm_head to the embedding, the weights hold a different 'lm_head\.weight'",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_corrupt_checkpoint_fails_its_load_naming_why(good, tmp_path, case):
    d = tmp_path / "m"
    shutil.copytree(good, d)
    corrupt, message = CASES[case]
    corrupt(d)
    with pytest.raises(checkpoint.CheckpointError, match=message):
        checkpoint.load(str(d), dtype="float32")


def test_the_catalog_is_at_least_twenty_corruptions_and_the_good_directory_loads(good):
    assert len(CASES) >= 20
    cfg, params = checkpoint.load(str(good), dtype="float32")
    assert cfg.n_layers == 2 and cfg.qkv_bias and params.lm_head is not None


def test_unused_tensors_load_when_asked(good, tmp_path):
    """The opt-out: allow_unused=True loads despite an extra tensor (and the CLI's --allow-unused-weights)."""
    d = tmp_path / "m"
    shutil.copytree(good, d)
    edit(d, lambda ts: set_(ts, "model.layers.0.mlp.extra.weight", torch.zeros(3)))
    checkpoint.load(str(d), dtype="float32", allow_unused=True)
    args = ["--model", str(d), "--prompt-ids", "1,2", "--max-new-tokens", "2", "--no-progress", "--mode", "eager"]
    assert len(generate.main(args + ["--greedy", "--allow-unused-weights"])["tokens"][0]) == 2


def test_weights_that_overflow_the_load_dtype_are_non_finite(good, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(good, d)
    edit(d, lambda ts: ts[DOWN].view(-1).__setitem__(0, 1e6))  # fine in float32, inf in float16
    checkpoint.load(str(d), dtype="float32")
    with pytest.raises(checkpoint.CheckpointError, match=rf"{DOWN} \(after the cast to the load dtype\)"):
        checkpoint.load(str(d), dtype="float16")


@pytest.mark.parametrize(
    "name, text, call, message",
    [
        ("tokenizer.json", "{not json", checkpoint.load_tokenizer, r"tokenizer\.json: not a valid tokenizer"),
        ("generation_config.json", "{", checkpoint.eos_token_ids, r"generation_config\.json: not valid JSON"),
    ],
)
def test_corrupt_side_files_name_the_file(good, tmp_path, name, text, call, message):
    d = tmp_path / "m"
    shutil.copytree(good, d)
    (d / name).write_text(text)
    with pytest.raises(checkpoint.CheckpointError, match=message):
        call(str(d))


def test_the_command_line_reports_a_bad_checkpoint_in_one_line(good, tmp_path, capsys):
    d = tmp_path / "m"
    shutil.copytree(good, d)
    edit(d, lambda ts: ts[DOWN].view(-1).__setitem__(5, float("nan")))
    with pytest.raises(SystemExit) as e:
        generate.main(["--model", str(d), "--prompt-ids", "1", "--no-progress", "--mode", "eager"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and "\n" not in err and DOWN in err and "Traceback" not in err
    with pytest.raises(checkpoint.CheckpointError):  # --debug: the exception itself, traceback and all
        generate.main(["--model", str(d), "--prompt-ids", "1", "--no-progress", "--mode", "eager", "--debug"])
    assert os.path.isdir(d)
