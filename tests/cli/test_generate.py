"""Sampling with a KV cache: the same tokens as recomputing the context, deterministic, never a padded id."""

import dataclasses

import pytest
import torch

from modelpar.generate import generate, sample_next
from modelpar.model import ModelConfig, build_stage
from modelpar.tensor_parallel import KVCache

GPT = ModelConfig(vocab_size=50, seq_len=16, hidden=32, heads=4, layers=2, init_std=0.3)
LLAMA = dataclasses.replace(GPT, arch="llama", kv_heads=2)


def _model(cfg, dtype=torch.float64):
    return build_stage(cfg, seed=1, dtype=dtype)


@pytest.mark.numerics
@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt", "llama"])
def test_cached_logits_equal_the_whole_prefix(cfg):
    model = _model(cfg)
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    whole = model(ids)
    cache = KVCache(cfg.seq_len)
    steps = [model(ids[:, :5], cache)] + [model(ids[:, i:i + 1], cache) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=0, atol=1e-12)
    assert cache.pos == 12


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt", "llama"])
def test_kv_cache_gives_the_tokens_of_recomputing_the_prefix(cfg):
    model = _model(cfg)
    prompt = [3, 1, 4, 1, 5]
    for kw in ({"seed": 7}, {"seed": 8, "top_k": 5, "temperature": 0.7}, {"temperature": 0.0}):
        cached = generate(model, prompt, 30, **kw)  # 35 tokens > seq_len 16: the window restarts
        assert cached == generate(model, prompt, 30, use_cache=False, **kw)
        assert len(cached) == 30 and all(0 <= t < 50 for t in cached)
    assert generate(model, prompt, 12, seed=3) == generate(model, prompt, 12, seed=3)  # deterministic
    assert generate(model, prompt, 12, seed=3) != generate(model, prompt, 12, seed=4)


def test_each_new_token_costs_one_position():
    model = _model(LLAMA)
    fed: list[int] = []
    model.embed.register_forward_hook(lambda m, args, out: fed.append(args[0].shape[1]))
    generate(model, [1, 2, 3], 10)
    assert fed == [3] + [1] * 9  # prefill, then one position per token
    fed.clear()
    generate(model, [1, 2, 3], 10, use_cache=False)
    assert fed == list(range(3, 13))


def test_greedy_is_the_argmax_and_top_1_is_greedy():
    model = _model(GPT)
    prompt = [5, 6, 7]
    greedy = generate(model, prompt, 6, temperature=0.0)
    context = list(prompt)
    for token in greedy:
        assert token == int(model(torch.tensor([context]))[0, -1, :50].argmax())
        context.append(token)
    assert generate(model, prompt, 6, top_k=1, seed=11) == greedy


def test_padded_ids_are_never_sampled():
    model = _model(GPT)  # 50 ids padded to 64
    with torch.no_grad():
        model.head.weight[50:] = 100.0  # the padded rows would win every draw if they could
    tokens = generate(model, [1, 2], 30, temperature=2.0, seed=0)
    assert all(t < 50 for t in tokens)
    logits = torch.zeros(64)
    logits[50:] = 1e9
    g = torch.Generator().manual_seed(0)
    assert all(sample_next(logits, 50, 1.0, None, g) < 50 for _ in range(50))
    assert sample_next(logits, 50, 0.0, None, g) < 50


def test_generation_does_not_change_the_model():
    model = _model(LLAMA)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    generate(model, [1], 5)
    assert model.training and all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt": []}, r"prompt must hold at least one token"),
    ({"prompt": [50]}, r"prompt ids must be in \[0, 50\), got 50"),
    ({"max_new_tokens": -1}, r"max_new_tokens must be >= 0, got -1"),
    ({"temperature": -0.5}, r"temperature must be >= 0.0, got -0.5"),
    ({"top_k": 0}, r"top_k must be >= 1, got 0"),
])
def test_bad_input(kwargs, message):
    args = {"prompt": [1], "max_new_tokens": 3, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate(_model(GPT), args.pop("prompt"), args.pop("max_new_tokens"), **args)
    with pytest.raises(ValueError, match=r"the whole model on one process"):
        generate(build_stage(GPT, 0, 2), [1], 3)


# --- the command line --------------------------------------------------------------------------------
def _export(cfg, path):
    """An export as the brief's format has it: the single-process state dict, the config in the metadata."""
    import json

    from safetensors.torch import save_file

    model = build_stage(cfg, seed=1)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if not (cfg.tie_embeddings and k == "head.weight")}
    save_file(tensors, str(path), metadata={"format": "modelpar", "config": json.dumps(cfg.to_dict())})
    return model


def test_generate_command_prints_the_prompt_and_a_seeded_continuation(tmp_path, capsys):
    from modelpar.cli import main

    cfg = ModelConfig(seq_len=16, hidden=32, heads=4, layers=2, tie_embeddings=True, init_std=0.3)  # bytes
    model = _export(cfg, tmp_path / "model.safetensors").eval()
    args = ["generate", str(tmp_path / "model.safetensors"), "--prompt", "Hi", "--max-new-tokens", "8", "--seed", "5",
            "--device", "cpu"]
    assert main(args) == 0
    first = capsys.readouterr().out
    want = bytes(generate(model, list(b"Hi"), 8, seed=5)).decode("utf-8", errors="replace")
    assert first == "Hi" + want + "\n"
    assert main([*args[:2], *args[2:]]) == 0 and capsys.readouterr().out == first  # the same seed, the same text
    assert main(["generate", str(tmp_path), *args[2:]]) == 0 and capsys.readouterr().out == first  # the folder


def test_generate_command_on_a_hugging_face_directory(tmp_path, capsys):
    from modelpar.cli import main
    from modelpar.hf import save_hf

    cfg = dataclasses.replace(LLAMA, vocab_size=256)
    save_hf(_model(cfg, torch.float32), cfg, tmp_path)
    assert main(["generate", str(tmp_path), "--prompt", "ab", "--max-new-tokens", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("ab")


@pytest.mark.parametrize("flags, message", [
    (["/nonexistent"], "'/nonexistent' does not exist"),
    (["{tmp}/x.safetensors"], "is not a modelpar export (its metadata has format 'pt'"),
    (["{tmp}", "--top-k", "0"], "--top-k must be >= 1, got 0"),
    (["{tmp}/x.safetensors", "--prompt", ""], "--prompt must not be empty"),
])
def test_generate_command_bad_input_is_one_line(tmp_path, capsys, flags, message):
    from safetensors.torch import save_file

    from modelpar.cli import main

    save_file({"w": torch.zeros(2)}, str(tmp_path / "x.safetensors"), metadata={"format": "pt"})
    flags = [f.format(tmp=tmp_path) for f in flags]
    prompt = [] if "--prompt" in flags else ["--prompt", "x"]
    assert main(["generate", *flags, *prompt]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("modelpar generate: error: ") and message in err and "\n" not in err


@pytest.mark.cuda
def test_the_same_tokens_on_cuda_and_on_the_cpu():
    model = _model(LLAMA)
    cpu = generate(model, [1, 2, 3], 20, seed=2, top_k=10)
    assert generate(model.cuda(), [1, 2, 3], 20, seed=2, top_k=10) == cpu  # float64: the draws agree


def test_generate_command_uses_the_tokenizer_beside_the_export(tmp_path, capsys):
    from modelpar.cli import main
    from modelpar.text import train_bpe

    tokenizer = train_bpe(["the pipeline schedule runs the stages " * 50], 300)
    tokenizer.save(tmp_path / "tokenizer.json")
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, seq_len=16, hidden=32, heads=4, layers=2, init_std=0.3)
    model = _export(cfg, tmp_path / "model.safetensors").eval()
    assert main(["generate", str(tmp_path), "--prompt", "the pipeline", "--max-new-tokens", "6", "--seed", "3"]) == 0
    tokens = generate(model, tokenizer.encode("the pipeline"), 6, seed=3)
    if tokenizer.eos_id in tokens:
        tokens = tokens[:tokens.index(tokenizer.eos_id)]
    assert capsys.readouterr().out == "the pipeline" + tokenizer.decode(tokens) + "\n"


def test_a_long_generation_prints_as_it_goes_and_ctrl_c_ends_it_in_one_line(tmp_path):
    """Issue 35: --max-new-tokens 1000000 printed nothing until the end. The text comes token by token (flushed):
    a real SIGINT then ends the line, says how many tokens came, exit 130, no traceback."""
    import signal
    import subprocess
    import sys
    import threading

    from _signals import CTRL_C_DEFAULT
    from _wait import join, wait_until

    cfg = ModelConfig(seq_len=16, hidden=32, heads=4, layers=2, tie_embeddings=True, init_std=0.3)  # bytes
    _export(cfg, tmp_path / "model.safetensors")
    proc = subprocess.Popen([sys.executable, "-m", "modelpar", "generate", str(tmp_path / "model.safetensors"),
                             "--prompt", "Hi", "--max-new-tokens", "1000000", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **CTRL_C_DEFAULT)
    out = bytearray()

    def read() -> None:
        for chunk in iter(lambda: proc.stdout.read1(64), b""):
            out.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_until(lambda: len(out) >= 50, "50 bytes of streamed text", alive=lambda: proc.poll() is None)
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    join(reader, 60)
    err = proc.stderr.read().decode()
    assert out.startswith(b"Hi") and out.endswith(b"\n") and code == 130
    assert err.startswith("modelpar generate: generation stopped after ") and err.count("\n") == 1, err
    assert 16 <= int(err.split("after ")[1].split()[0]) < 1000000  # 48 bytes: a replaced byte prints 3
