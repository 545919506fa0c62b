"""A ``Hook`` subclass defines only the methods the loop calls: a misspelt one is refused at
its class statement, naming the class, the method and the known ones."""

import pytest

from ntp_jax.training.hooks import HOOK_METHODS, Hook


def test_a_misspelt_hook_method_is_refused_at_the_class_statement():
  with pytest.raises(TypeError) as raised:
    class Misspelt(Hook):  # noqa: F841  (never made: the statement raises)
      def after_step(self, info):
        pass
  message = str(raised.value)
  assert message.startswith("hook test_a_misspelt_hook_method_is_refused_at_the_class_statement"
                            ".<locals>.Misspelt.after_step: a Hook has no method 'after_step'")
  assert "\n" not in message and all(method in message for method in HOOK_METHODS)


def test_known_methods_private_helpers_and_data_are_accepted():
  class Fine(Hook):
    every = 2
    label = "data, not a method"

    def on_step(self, info):
      self._helper()

    def _helper(self):
      pass

  assert Fine().every == 2


@pytest.mark.parametrize("kind", [staticmethod, classmethod])
def test_static_and_class_methods_are_methods_too(kind):
  with pytest.raises(TypeError, match=r"\.on_stpe: a Hook has no method 'on_stpe'"):
    type("Typo", (Hook,), {"on_stpe": kind(lambda *_: None)})
