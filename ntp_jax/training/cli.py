"""``train.py``'s command line: every mistake as one line naming the file or the field.

absl and ml_collections report a missing config file, a config file that
raises, an override of the wrong type or of a field that does not exist as
tracebacks of their own; ``parse_command_line`` turns each into a
``ConfigError`` (``train.py`` prints ``error: ...`` and exits 2). It imports
no JAX: it runs before ``train.py`` sets the device count.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from collections.abc import Sequence

from absl import flags
from ml_collections.config_flags import config_flags

from ntp_jax.errors import ConfigError

# What an override's value failed to parse as, by the parser's own message.
_EXPECTED = (("invalid literal for int()", "expected a whole number"),
             ("could not convert string to float", "expected a number"),
             ("Non-boolean argument", "expected True or False"))


def parse_command_line(argv: Sequence[str], flag_values: flags.FlagValues = flags.FLAGS,
                       name: str = "config") -> list[str]:
  """absl's parsing of ``argv`` (``--config FILE`` and ``--config.FIELD=VALUE`` overrides).

  Args:
    argv: the command line, program name first.
    flag_values: where the config flag (``config_flags.DEFINE_config_file(name)``) lives.
    name: the config flag's name.

  Returns:
    ``argv`` less the flags (the program name only, when nothing is left over).

  Raises:
    ConfigError: one line naming the file or the field: no ``--config``, no
      such file, a file that raises while loading (its error and line), an
      override of a field that does not exist or of the wrong type, an
      unknown flag, a left-over argument.
  """
  path = config_path(argv, name)
  if any(a in ("-h", "--help", "--helpshort", "--helpfull", "-?") for a in argv[1:]):
    # absl prints the help and exits; it knows -? but not -h
    return flag_values([a if a != "-h" else "--help" for a in argv])
  if path is None:
    raise ConfigError(f"--{name}: required, e.g. --{name} configs/gpt_tiny.py")
  file = path.split(":", 1)[0]
  if not os.path.isfile(file):
    raise ConfigError(f"--{name}: no config file {file}")
  try:
    rest = flag_values(list(argv))
  except Exception as err:  # absl and the config file raise many kinds; sort them
    loading = _loading_error(err)
    if loading is not None:
      raise ConfigError(f"{file}: loading it raised {loading}") from None
    if isinstance(err, flags.IllegalFlagValueError):
      raise _bad_value(str(err), name) from None
    if isinstance(err, AttributeError) and "attribute 'get_config'" in str(err):
      raise ConfigError(f"{file}: defines no get_config() (a config file's get_config "
                        "returns an ml_collections.ConfigDict; see configs/base.py)") from None
    if isinstance(err, (AttributeError, KeyError)):
      raise _unknown_field(str(err), argv, name) from None
    if isinstance(err, flags.UnrecognizedFlagError):
      raise ConfigError(f"--{err.flagname}: no such flag; train.py takes --{name} FILE and "
                        f"--{name}.FIELD=VALUE overrides") from None
    if isinstance(err, flags.Error):
      raise ConfigError(str(err)) from None
    raise
  config = flag_values[name].value
  if isinstance(config, config_flags._ErrorConfig):  # an OSError inside get_config()
    raise ConfigError(f"{file}: loading it raised {_describe(config._error)}")
  if len(rest) > 1:
    raise ConfigError(f"{' '.join(rest[1:])}: unexpected argument(s); fields are set as "
                      f"--{name}.FIELD=VALUE")
  return rest


def config_path(argv: Sequence[str], name: str = "config") -> str | None:
  """The value of ``--NAME FILE`` / ``--NAME=FILE`` in ``argv`` (the last one), or None."""
  path = None
  for i, arg in enumerate(argv):
    match = re.fullmatch(rf"--?{name}(?:=(.*))?", arg)
    if match:
      path = match[1] if match[1] is not None else (argv[i + 1] if i + 1 < len(argv) else "")
  return path


def _loading_error(err: BaseException) -> str | None:
  """``Type: message (file:line)`` when ``err`` (or what it wraps) came from loading the
  config file (raised below ml_collections' file parser), else None."""
  parse = config_flags.ConfigFileFlagParser.parse.__code__
  for inner in _chain(err):
    frames = traceback.extract_tb(inner.__traceback__)
    codes = [tb.tb_frame.f_code for tb in _tracebacks(inner.__traceback__)]
    if parse in codes and codes.index(parse) < len(codes) - 1:
      return _describe(inner, frames)
  return None


def _chain(err: BaseException) -> list[BaseException]:
  """``err`` and what it was raised from or during, the innermost first."""
  chain = []
  while err is not None and err not in chain:
    chain.append(err)
    err = err.__cause__ or err.__context__
  return chain[::-1]


def _tracebacks(tb):
  while tb is not None:
    yield tb
    tb = tb.tb_next


def _describe(err: BaseException, frames=None) -> str:
  """``Type: message`` and where, in the user's files (not a library's), it was raised."""
  text = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
  if isinstance(err, SyntaxError) and err.filename:
    return f"{type(err).__name__}: {err.msg} ({err.filename}:{err.lineno})"
  mine = [f for f in frames or () if not f.filename.startswith(("<", sys.prefix,
                                                                 sys.base_prefix))]
  return f"{text} ({mine[-1].filename}:{mine[-1].lineno})" if mine else text


def _bad_value(text: str, name: str) -> ConfigError:
  """``flag --config.train.steps=abc: invalid literal ...`` -> ``train.steps: expected ...``."""
  match = re.match(rf"flag --{name}\.([\w.]+)=(.*?): (.*)", text, re.S)
  if not match:
    return ConfigError(text)
  field, value, why = match.groups()
  for clue, expected in _EXPECTED:
    if clue in why:
      return ConfigError(f"{field}: {expected}, got {value!r}")
  return ConfigError(f"{field}: cannot read {value!r} ({why})")


def _unknown_field(text: str, argv: Sequence[str], name: str) -> ConfigError:
  """ml_collections' error for an override of a field that does not exist, as one line
  naming the field as typed up to the unknown name, with its suggestion."""
  names = re.findall(r"\w+", text)
  wrong = names[0] if names else name
  guess = re.search(r'Did you mean "(\w+)"', text)
  field, suggestion = wrong, ""
  for override in (a[len(name) + 3:].split("=")[0] for a in argv[1:]
                   if a.startswith(f"--{name}.")):
    parts = override.split(".")
    if wrong in parts:
      at = parts.index(wrong)
      field = ".".join(parts[:at + 1])
      if guess:
        suggestion = f"; did you mean {'.'.join(parts[:at] + [guess[1]])}?"
      break
  return ConfigError(f"{field}: no such config field{suggestion}")
