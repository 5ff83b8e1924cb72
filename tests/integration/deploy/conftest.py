from tests.testhosts import testhost, testhost_factory  # noqa: F401  (pytest fixtures)
