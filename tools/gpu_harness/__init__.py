# SPDX-License-Identifier: Apache-2.0
"""The GPU harness: jobs run as scripts (tools/gpu_harness/JOB.py), above the
shared modules they import by package name (engine, training, data,
step_trace, fp64_reference). CONTRIBUTING.md states the layers; .importlinter
checks them."""
