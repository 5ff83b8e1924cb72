from tests.engine_threads import one_thread  # noqa: F401  (autouse)
