"""``dir(eh)`` lists what a user can use: the public names, not the modules the package imports to work."""

import eigenhooks as eh


def test_dir_lists_the_public_names_and_no_imported_tool():
    names = dir(eh)
    assert not {"importlib", "sys", "types", "warnings"} & set(names)
    assert {"spectra", "monitor", "steer", "read_tokens", "__version__"} <= set(names)
