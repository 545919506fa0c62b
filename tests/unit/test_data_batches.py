"""Batches: shape, dtype, range, seeded order, cursor, epochs, splits."""

import numpy as np
import pytest

from ntp_jax.data import DataError, make_dataset

SEQ_LEN = 15
NUM_SEQUENCES = 40


@pytest.fixture(scope="module")
def stdlib_settings(tmp_path_factory):
  """A small stdlib corpus: 200 kB, 512-token vocabulary, 64-token inputs."""
  return dict(path=None, vocab_size=512, seq_len=64,
              cache_dir=str(tmp_path_factory.mktemp("work")), seed=0,
              max_corpus_bytes=200_000)


@pytest.fixture(scope="module")
def stdlib_dataset(stdlib_settings):
  return make_dataset(**stdlib_settings)


@pytest.fixture
def numbered_bin(tmp_path):
  """A .bin file whose sequence k starts with token k: rows are traceable."""
  tokens = np.arange(NUM_SEQUENCES * (SEQ_LEN + 1) + 7, dtype="<u2")
  tokens[:NUM_SEQUENCES * (SEQ_LEN + 1)].reshape(NUM_SEQUENCES, -1)[:, 0] = (
      np.arange(NUM_SEQUENCES))
  path = tmp_path / "numbered.bin"
  tokens.tofile(path)
  return str(path)


def numbered_dataset(path, tmp_path, seed=0, **kwargs):
  return make_dataset(path, vocab_size=1024, seq_len=SEQ_LEN,
                      cache_dir=str(tmp_path / "work"), seed=seed, **kwargs)


def test_shape_dtype_and_token_range(stdlib_dataset):
  batch = stdlib_dataset.batch(0, 8)
  assert batch.shape == (8, stdlib_dataset.seq_len + 1)
  assert batch.dtype == np.int32
  assert batch.min() >= 0
  assert batch.max() < stdlib_dataset.vocab_size


def test_every_token_below_vocab_size(stdlib_dataset):
  steps = stdlib_dataset.num_sequences // 64
  seen = np.concatenate([stdlib_dataset.batch(s, 64) for s in range(steps)])
  assert seen.max() < stdlib_dataset.vocab_size
  # Most of the learned vocabulary is used, so ids are not all bytes.
  assert len(np.unique(seen)) > stdlib_dataset.vocab_size // 2


def test_same_seed_and_step_give_same_batch(stdlib_dataset, stdlib_settings,
                                            tmp_path):
  # A dataset built from scratch in another workdir: tokenizer training,
  # encoding and ordering must all be deterministic.
  rebuilt = make_dataset(**{**stdlib_settings, "cache_dir": str(tmp_path)})
  assert not rebuilt.from_cache
  for step in (0, 1, 17):
    np.testing.assert_array_equal(stdlib_dataset.batch(step, 4),
                                  rebuilt.batch(step, 4))


def test_different_seeds_give_different_batches(stdlib_settings):
  first = make_dataset(**{**stdlib_settings, "seed": 0})
  second = make_dataset(**{**stdlib_settings, "seed": 1})
  assert not np.array_equal(first.batch(0, 8), second.batch(0, 8))


def test_batch_is_independent_of_call_order(stdlib_settings):
  forward = make_dataset(**stdlib_settings)
  expected = [forward.batch(step, 4) for step in range(30)]
  backward = make_dataset(**stdlib_settings)
  for step in reversed(range(30)):
    np.testing.assert_array_equal(backward.batch(step, 4), expected[step])
  # Asking again after other steps changes nothing either.
  np.testing.assert_array_equal(forward.batch(3, 4), expected[3])


def test_epoch_visits_every_sequence_once(numbered_bin, tmp_path):
  ds = numbered_dataset(numbered_bin, tmp_path)
  assert ds.num_sequences == NUM_SEQUENCES
  rows = np.concatenate([ds.batch(s, 8) for s in range(NUM_SEQUENCES // 8)])
  assert sorted(rows[:, 0]) == list(range(NUM_SEQUENCES))
  assert list(rows[:, 0]) != list(range(NUM_SEQUENCES))  # shuffled
  # Each row is the packed slice of the stream: sequence k, tokens in order.
  k = rows[0, 0]
  np.testing.assert_array_equal(
      rows[0, 1:], np.arange(k * (SEQ_LEN + 1) + 1, (k + 1) * (SEQ_LEN + 1)))


def test_epochs_are_reshuffled_and_batches_straddle_them(numbered_bin,
                                                         tmp_path):
  ds = numbered_dataset(numbered_bin, tmp_path, seed=5)
  order0 = np.random.default_rng(5).permutation(NUM_SEQUENCES)
  order1 = np.random.default_rng(6).permutation(NUM_SEQUENCES)
  walk = np.concatenate([order0, order1])
  # batch_size 12 does not divide 40: step 3 takes 4 rows of epoch 0 and 8
  # of epoch 1.
  rows = np.concatenate([ds.batch(s, 12) for s in range(6)])[:, 0]
  np.testing.assert_array_equal(rows, walk[:72])
  assert not np.array_equal(order0, order1)


def packed_rows(path):
  """The rows of a numbered .bin file as packing cuts them, [N, SEQ_LEN + 1]."""
  tokens = np.fromfile(path, dtype="<u2")[:NUM_SEQUENCES * (SEQ_LEN + 1)]
  return tokens.reshape(NUM_SEQUENCES, SEQ_LEN + 1)


def test_changing_counts_take_each_sequence_once_per_epoch(numbered_bin,
                                                           tmp_path):
  ds = numbered_dataset(numbered_bin, tmp_path, seed=2)
  counts = [5, 3, 7, 2, 11, 1, 40, 6, 9]  # 84 sequences: straddles 2 epochs
  cursor, ids, rows = 0, [], []
  for count in counts:
    ids.append(ds.sequence_ids(cursor, count))
    rows.append(ds.sequences(cursor, count))
    cursor += count
  ids, rows = np.concatenate(ids), np.concatenate(rows)
  assert ids.dtype == np.int64 and ids.shape == (cursor,)
  assert rows.dtype == np.int32 and rows.shape == (cursor, SEQ_LEN + 1)
  for epoch in range(2):
    assert sorted(ids[epoch * NUM_SEQUENCES:(epoch + 1) * NUM_SEQUENCES]) == (
        list(range(NUM_SEQUENCES)))
  np.testing.assert_array_equal(rows, packed_rows(numbered_bin)[ids])
  # The walk does not depend on how it was cut into counts, nor on the
  # calls a dataset saw before (a resumed run starts at its cursor).
  resumed = numbered_dataset(numbered_bin, tmp_path, seed=2)
  np.testing.assert_array_equal(resumed.sequence_ids(50, cursor - 50),
                                ids[50:])
  np.testing.assert_array_equal(
      np.concatenate([ds.sequence_ids(c, 12) for c in range(0, 84, 12)]), ids)


def test_batch_is_sequences_at_step_times_batch_size(numbered_bin, tmp_path):
  ds = numbered_dataset(numbered_bin, tmp_path)
  for step, batch_size in [(0, 8), (3, 12), (7, 40), (2**33, 7)]:
    np.testing.assert_array_equal(
        ds.batch(step, batch_size), ds.sequences(step * batch_size,
                                                 batch_size))


def test_sequences_straddle_epochs_at_any_cursor(numbered_bin, tmp_path):
  ds = numbered_dataset(numbered_bin, tmp_path, seed=9)
  epoch = 2**40  # positions far past int32
  cursor = epoch * NUM_SEQUENCES - 3
  np.testing.assert_array_equal(
      ds.sequence_ids(cursor, 7),
      np.concatenate([ds.epoch_order(epoch - 1)[-3:],
                      ds.epoch_order(epoch)[:4]]))
  orders = [ds.epoch_order(e) for e in (0, 1, epoch)]
  for order in orders:
    assert sorted(order) == list(range(NUM_SEQUENCES))
  assert not np.array_equal(orders[0], orders[1])
  assert not np.array_equal(orders[1], orders[2])


def test_bad_cursor_or_count(numbered_bin, tmp_path):
  ds = numbered_dataset(numbered_bin, tmp_path)
  with pytest.raises(DataError, match=r"^train\.batch_size: "):
    ds.sequence_ids(0, 0)
  with pytest.raises(DataError, match=r"^data\.path: .*fewer than one batch"):
    ds.sequences(0, NUM_SEQUENCES + 1)
  for cursor in (-1, 1.5, True):
    with pytest.raises(ValueError, match="cursor"):
      ds.sequence_ids(cursor, 4)


def test_batch_larger_than_corpus_is_a_clear_error(numbered_bin, tmp_path):
  ds = numbered_dataset(numbered_bin, tmp_path)
  with pytest.raises(DataError) as error:
    ds.batch(0, NUM_SEQUENCES + 1)
  message = str(error.value)
  assert message.startswith("data.path:")
  assert f"only {NUM_SEQUENCES} train sequences" in message
  assert "\n" not in message
  with pytest.raises(DataError):
    ds.check_batch_size(0)
  with pytest.raises(ValueError):
    ds.batch(-1, 4)


def test_validation_split_is_the_held_out_tail(numbered_bin, tmp_path):
  ds = numbered_dataset(numbered_bin, tmp_path, val_fraction=0.25)
  val = ds.validation
  assert (ds.num_sequences, val.num_sequences) == (30, 10)
  train_rows = np.concatenate([ds.batch(s, 10) for s in range(3)])[:, 0]
  val_rows = val.batch(0, 10)[:, 0]
  assert sorted(train_rows) == list(range(30))
  assert sorted(val_rows) == list(range(30, 40))
  assert val.validation is None
  assert numbered_dataset(numbered_bin, tmp_path).validation is None


def test_tiny_validation_fraction_holds_out_one_sequence(numbered_bin,
                                                         tmp_path):
  ds = numbered_dataset(numbered_bin, tmp_path, val_fraction=0.001)
  assert ds.validation.num_sequences == 1


def test_describe_is_a_few_short_lines(stdlib_dataset):
  line = stdlib_dataset.describe()
  assert len(line.splitlines()) == 3
  assert "stdlib" in line
  assert f"{stdlib_dataset.num_tokens:,} tokens" in line
  assert f"{stdlib_dataset.num_sequences:,} train" in line
  assert stdlib_dataset.tokenizer_path in line
