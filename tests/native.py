"""Tests of SpecLens's native CPU kernel skip where it cannot be built (no compiler, another platform),
so the README's test command passes anywhere. CI sets SPECLENS_REQUIRE_NATIVE=1: there a build that
fails fails those tests instead of silently skipping them."""

import os

import pytest

from speclens.engine.runtime.native_kernels import native_build


def native_or_skip():
    """The built kernel module; otherwise skip, or fail under SPECLENS_REQUIRE_NATIVE=1."""
    build = native_build()
    if build.module is None:
        message = f"native kernel unavailable: {build.message}"
        if os.environ.get("SPECLENS_REQUIRE_NATIVE") == "1":
            pytest.fail(f"{message} (SPECLENS_REQUIRE_NATIVE=1)")
        pytest.skip(message)
    return build.module


@pytest.fixture
def native_kernel():
    return native_or_skip()


needs_native = pytest.mark.usefixtures("native_kernel")


def integer_or_skip():
    """The built kernel module where its integer kernels passed their self-check; otherwise skip, or
    fail under SPECLENS_REQUIRE_NATIVE=1 (every x86 CPU CI runs on has AVX2, the integer floor)."""
    module = native_or_skip()
    build = native_build()
    if not build.integer:
        message = f"integer kernels unavailable: {build.integer_message}"
        if os.environ.get("SPECLENS_REQUIRE_NATIVE") == "1":
            pytest.fail(f"{message} (SPECLENS_REQUIRE_NATIVE=1)")
        pytest.skip(message)
    return module


@pytest.fixture
def integer_kernel():
    return integer_or_skip()


needs_integer = pytest.mark.usefixtures("integer_kernel")
