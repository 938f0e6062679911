"""`kimik3 generate`: inputs, outputs, errors and the built-in checkpoint, first with the fake model of
test_generate_loop standing in, then end to end with the real model on the tiny checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import kimik3_jax.generate.cli as generate_cli
from kimik3_jax.cli import main
from kimik3_jax.tokenizer import K3Tokenizer
from test_generate_loop import fake_decode_step, fake_init_state, fake_prefill, reference


@pytest.fixture
def fake_model(monkeypatch):
    monkeypatch.setattr(generate_cli, "model_functions", lambda: (fake_init_state, fake_prefill, fake_decode_step))


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return K3Tokenizer.from_dir(tiny_ckpt)


def generate(ckpt, *argv) -> int:
    return main(["generate", "--checkpoint", str(ckpt), "--quiet", *argv])


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_jsonl(path, lines) -> None:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")


def test_prompts_come_back_in_order_with_their_ids_and_finish_reasons(tiny_ckpt, tok, cfg, tmp_path, fake_model):
    out = tmp_path / "out.jsonl"
    assert generate(tiny_ckpt, "--prompt", "Hello world", "--prompt", "Hi", "--max-new-tokens", "60",
                    "--temperature", "0", "--out", str(out)) == 0
    rows = read_jsonl(out)
    assert [r["prompt"] for r in rows] == ["Hello world", "Hi"]
    for r in rows:
        assert (r["token_ids"], r["finish_reason"]) == reference(tok.encode(r["prompt"]), 60, cfg)
        assert r["completion"] == tok.decode(r["token_ids"])
    assert rows[0]["finish_reason"] == "eos"  # the fake counts up to 49, then stops


def test_bad_lines_are_named_and_the_others_still_generated(tiny_ckpt, tmp_path, fake_model, capsys):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(src, [{"prompt": "one"}, "{not json", "", {"prompt": ""}, {"prompt": "word " * 5000},
                      {"prompt": "x", "temprature": 1}, {"messages": [{"role": "robot", "content": "x"}]},
                      {"prompt": "y", "top_k": 1.5}, {"prompt": "y", "messages": []}, [1, 2],
                      {"messages": [{"role": "user", "content": "two"}], "id": "q2"}])
    assert generate(tiny_ckpt, "--prompts-file", str(src), "--max-new-tokens", "4", "--out", str(out)) == 2
    rows = read_jsonl(out)
    assert [r["line"] for r in rows] == [1, 2, 4, 5, 6, 7, 8, 9, 10, 11]  # line 3 is blank: not an input
    good = [r for r in rows if "error" not in r]
    assert [r["line"] for r in good] == [1, 11] and good[1]["id"] == "q2"
    assert all(len(r["token_ids"]) == 4 for r in good)
    errors = {r["line"]: r["error"] for r in rows if "error" in r}
    assert "not valid JSON" in errors[2] and "prompt is empty" in errors[4]
    assert "max_position_embeddings" in errors[5] and "'temprature'" in errors[6]
    assert "messages[0].role" in errors[7] and "top_k" in errors[8]
    assert '"prompt" or "messages"' in errors[9] and '"prompt" or "messages"' in errors[10]
    err = capsys.readouterr().err
    for n in errors:
        assert f"{src}:{n}:" in err
    assert "2 of 10 prompts generated" in err and "tokens/s" in err


def test_per_line_settings_override_the_flags(tiny_ckpt, tmp_path, fake_model):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(src, [{"prompt": "same", "temperature": 0}, {"prompt": "same", "temperature": 5, "top_k": 1},
                      {"prompt": "same", "max_new_tokens": 3}])
    assert generate(tiny_ckpt, "--prompts-file", str(src), "--max-new-tokens", "9", "--temperature", "3",
                    "--out", str(out)) == 0
    rows = read_jsonl(out)
    assert rows[0]["token_ids"] == rows[1]["token_ids"] and len(rows[0]["token_ids"]) == 9
    assert len(rows[2]["token_ids"]) == 3


def test_results_do_not_depend_on_the_batch_size(tiny_ckpt, tmp_path, fake_model):
    prompts = [a for p in ("a b", "c", "d e f", "g") for a in ("--prompt", p)]
    runs = []
    for size in ("1", "3"):
        out = tmp_path / f"out{size}.jsonl"
        assert generate(tiny_ckpt, *prompts, "--batch-size", size, "--temperature", "2", "--seed", "5",
                        "--max-new-tokens", "12", "--out", str(out)) == 0
        runs.append([r["token_ids"] for r in read_jsonl(out)])
    assert runs[0] == runs[1]


def test_chat_adds_the_split_reply_and_stdout_is_the_default(tiny_ckpt, fake_model, capsys):
    assert generate(tiny_ckpt, "--prompt", "Hi", "--chat", "--max-new-tokens", "5", "--temperature", "0") == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["reasoning"] == row["completion"] and row["answer"] == "" and row["tool_calls"] == []


def test_output_is_replaced_atomically(tiny_ckpt, tmp_path, fake_model):
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    assert generate(tiny_ckpt, "--prompt", "Hi", "--max-new-tokens", "2", "--out", str(out)) == 0
    assert len(read_jsonl(out)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


@pytest.mark.parametrize("argv,match", [
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompt", "x", "--batch-size", "0"], "--batch-size must be >= 1"),
    (["--prompt", "x", "--temperature", "-1"], "temperature must be"),
    (["--prompt", "x", "--top-p", "1.5"], "top_p must be"),
    (["--prompts-file", "/nonexistent/in.jsonl"], "--prompts-file /nonexistent/in.jsonl: cannot read it"),
    (["--prompts-file", os.devnull], f"--prompts-file {os.devnull} holds no prompts"),
    (["--prompt", "x", "--out", "/nonexistent/out.jsonl"], "--out /nonexistent/out.jsonl: its directory does not exist"),
])
def test_usage_errors_exit_2_and_name_the_flag(tiny_ckpt, argv, match, capsys):
    assert generate(tiny_ckpt, *argv) == 2
    assert match in capsys.readouterr().err


def test_a_missing_checkpoint_is_named(tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert str(tmp_path / "nope") in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["--prompt", "x", "--prompts-file", "in.jsonl"]])
def test_exactly_one_prompt_source(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", *argv])
    assert e.value.code == 2


def test_builtin_checkpoint_is_made_once_and_remade_when_broken(tmp_path, monkeypatch, fake_model, capsys):
    monkeypatch.setenv("KIMIK3_CACHE", str(tmp_path / "cache"))
    argv = ["generate", "--quiet", "--prompt", "Hi", "--max-new-tokens", "2"]
    assert main(argv) == 0
    made = tmp_path / "cache" / "tiny-seed0"
    assert "making the built-in tiny checkpoint" in capsys.readouterr().err
    stamp = (made / "config.json").stat().st_mtime_ns
    assert main(argv) == 0
    assert "making" not in capsys.readouterr().err and (made / "config.json").stat().st_mtime_ns == stamp
    next(made.glob("model-*.safetensors")).unlink()
    assert main(argv) == 0
    assert "making" in capsys.readouterr().err and (made / "tiktoken.model").is_file()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["tiny-seed0"]


# ----- the real model (these pass once kimik3_jax.model implements prefill and decode_step) --------

def test_real_model_generates_and_is_reproducible(tiny_ckpt, tok, tmp_path):
    outs = []
    for k in range(2):
        out = tmp_path / f"out{k}.jsonl"
        assert generate(tiny_ckpt, "--prompt", "Hello world", "--prompt", "The quick brown fox jumps over",
                        "--max-new-tokens", "6", "--temperature", "1", "--seed", "3", "--out", str(out)) == 0
        outs.append(read_jsonl(out))
    assert outs[0] == outs[1]
    for r in outs[0]:
        assert 1 <= len(r["token_ids"]) <= 6 and all(0 <= t < tok.vocab_size for t in r["token_ids"])
        assert r["finish_reason"] in ("eos", "length") and (r["finish_reason"] == "eos") == (len(r["token_ids"]) < 6)
        assert r["completion"] == tok.decode(r["token_ids"])


def test_real_model_greedy_rows_do_not_see_each_other(tiny_ckpt, tok, tmp_path):
    """Row 0 keeps its tokens whatever shares the batch: its logits are read at its own last position and
    the other row's length and padding do not leak in (same shapes both times: one compile)."""
    others = ["x", "a longer neighbour"]
    assert len(tok.encode(others[0])) < len(tok.encode(others[1])) <= 16
    results = []
    for k, other in enumerate(others):
        out = tmp_path / f"out{k}.jsonl"
        assert generate(tiny_ckpt, "--prompt", "Hello", "--prompt", other, "--max-new-tokens", "8",
                        "--temperature", "0", "--dtype", "float32", "--out", str(out)) == 0
        results.append(read_jsonl(out)[0]["token_ids"])
    assert results[0] == results[1]


def test_real_model_from_the_command_line_builtin_checkpoint_chat_float64(tmp_path):
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "KIMIK3_CACHE": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "kimik3_jax.cli", "generate", "--prompt", "What is 2+2?", "--chat",
                           "--max-new-tokens", "5", "--dtype", "float64", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = read_jsonl(out)
    assert {"reasoning", "answer", "tool_calls", "token_ids", "finish_reason"} <= set(row)
    assert "tokens/s" in proc.stderr and (tmp_path / "cache" / "tiny-seed0" / "config.json").is_file()
