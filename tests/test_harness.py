"""The test harness's own choices, which decide what the kernel tests exercise."""

from conftest import interpreter_default


def test_kernel_tests_run_compiled_when_pointed_at_a_gpu():
    assert interpreter_default({"COMPRESS_TEST_DEVICE": "cuda"}) == "0"


def test_kernel_tests_run_in_the_interpreter_otherwise():
    assert interpreter_default({}) == "1"
    assert interpreter_default({"COMPRESS_TEST_DEVICE": "cpu"}) == "1"
