"""The peer scripts of ``llmfw bench --compare-*`` run in another interpreter from source text: their preamble and
the measuring helpers pasted into them must execute on their own (a name the pasted source needs and the script
does not import broke every comparison once, and only the opt-in comparison runs would have shown it)."""
import pytest

from llmfw.commands.bench_peers import PEERS, peer_script

pytestmark = pytest.mark.fast

#: the lines that import the peer's own libraries: not installed here, and not what this test checks
PEER_IMPORTS = ("from llama_cpp", "import torch", "import transformers", "from transformers")


def runnable_preamble(script: str) -> str:
    """The script up to its first measurement (``wait_for_turn()``), without the peer's imports or its argv."""
    preamble = script.split("\nwait_for_turn()\n", 1)[0]
    lines = [line for line in preamble.splitlines()
             if not line.startswith(PEER_IMPORTS) and not line.startswith(("p = json.loads", "torch."))]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("peer", sorted(PEERS))
def test_peer_script_helpers_execute(peer: str) -> None:
    namespace: dict[str, object] = {}
    exec(compile(runnable_preamble(peer_script(PEERS[peer])), f"<{peer} script>", "exec"), namespace)
    for helper in ("current_rss", "peak_rss", "summarize", "random_tokens", "wait_for_turn", "timed_repetitions"):
        assert callable(namespace[helper]), helper
    tokens = namespace["random_tokens"](1000, 8)  # type: ignore[operator]
    assert len(tokens) == 8 and all(0 <= t < 1000 for t in tokens)
