#!/bin/sh
echo "coverage is not available in this offline Bazel setup" >&2
exit 1
