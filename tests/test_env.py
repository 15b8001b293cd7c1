"""mlx-fun's on/off environment switches are read one way (mlx_fun.core.env.flag)."""

from mlx_fun.core.env import flag


def test_unset_or_blank_is_the_default_off_words_are_off_anything_else_is_on():
    for default in (False, True):
        assert flag("X", default, {}) is default and flag("X", default, {"X": "  "}) is default
        for off in ("0", "false", "No", " OFF "):
            assert flag("X", default, {"X": off}) is False
        for on in ("1", "true", "yes", "On", "2"):
            assert flag("X", default, {"X": on}) is True
