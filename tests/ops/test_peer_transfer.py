"""The schedule of live moves across processes (``state.peer_transfer``), without devices:
who sends which piece to whom, and the rounds one ``ppermute`` each can carry."""

import collections

import pytest

from ntp_jax.state.peer_transfer import Move, choose_moves, rounds_of

Device = collections.namedtuple("Device", "id process_index")
P0 = [Device(i, 0) for i in range(4)]
P1 = [Device(4 + i, 1) for i in range(4)]


def test_a_device_that_holds_its_piece_keeps_it_and_others_come_from_their_own_process():
  path = ("params", "w")
  holders = {(path, 0): [P0[0], P1[0]], (path, 1): [P0[1]]}  # P1[1]'s copy of piece 1 died
  wanted = {(path, 0): [P0[0], P1[0]], (path, 1): [P0[1], P1[1]]}
  moves = choose_moves(holders, wanted)
  assert Move(path, 0, P0[0], P0[0]) in moves and Move(path, 0, P1[0], P1[0]) in moves
  assert Move(path, 1, P0[1], P0[1]) in moves
  assert Move(path, 1, P0[1], P1[1]) in moves  # the only live copy: across processes
  assert len(moves) == 4


def test_a_process_prefers_its_own_holders_and_spreads_the_sends():
  path = ("opt_state", "mu")
  holders = {(path, 0): [P0[0], P0[1], P1[2]]}
  wanted = {(path, 0): [P1[0], P1[1], P0[2], P0[3]]}
  moves = {m.target: m.source for m in choose_moves(holders, wanted)}
  assert moves[P1[0]] == P1[2] and moves[P1[1]] == P1[2]  # same process, though busier
  assert {moves[P0[2]], moves[P0[3]]} == {P0[0], P0[1]}  # one each


def test_a_piece_without_a_live_holder_is_named():
  path = ("params", "blocks", "attn", "wq")
  with pytest.raises(LookupError, match="params/blocks/attn/wq: no live replica holds piece 1"):
    choose_moves({(path, 0): [P0[0]]}, {(path, 0): [P1[0]], (path, 1): [P1[1]]})


def test_rounds_send_and_receive_at_most_once_per_device_and_keep_every_pair():
  pairs = [(0, 4), (0, 5), (1, 5), (2, 6), (0, 6), (3, 4)]
  rounds = rounds_of(pairs)
  assert sorted(p for r in rounds for p in r) == sorted(pairs)
  for r in rounds:
    assert len({s for s, _ in r}) == len(r) and len({t for _, t in r}) == len(r)
  assert len(rounds) == 3  # device 0 sends three pieces: no fewer rounds can carry them
