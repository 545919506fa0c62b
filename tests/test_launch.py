"""``python -m ntp_jax.launch`` passes its processes' output through, less gloo's chatter."""

import io

from ntp_jax.launch import _pump, is_chatter

CHATTER = ("[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks "
           "is : 1\n")


def test_only_gloo_connection_lines_are_chatter():
  assert is_chatter(CHATTER)
  assert is_chatter(CHATTER.replace("Rank 0", "Rank 3").replace("1", "7"))
  for line in ("step 0/150 | loss 7.6501 | compile + step 4.8 s | TP degree 8\n",
               "[Gloo] Rank 0 lost its connection\n",
               "error: lost process 1 of 2: no heartbeat for 30.0 s\n",
               "note: " + CHATTER):
    assert not is_chatter(line), line


def test_pump_prefixes_every_line_but_the_chatter():
  out = io.StringIO()
  _pump(io.BytesIO(f"plan: 2 DP replica(s)\n{CHATTER}step 0/3 | loss 7.6\n".encode()), "[1] ",
        out)
  assert out.getvalue() == "[1] plan: 2 DP replica(s)\n[1] step 0/3 | loss 7.6\n"
