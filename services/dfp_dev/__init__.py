"""Development and demo tooling: never shipped in the images.

The local demo (:mod:`dfp_dev.demo`), the serving check against a real vLLM (:mod:`dfp_dev.serving`),
the demo's and the tests' targets and tokenizer (:mod:`dfp_dev.targets`), a private Redis and process
groups (:mod:`dfp_dev.local`) and the gRPC code generator (:mod:`dfp_dev.protogen`). It drives the
services; no service imports it. The ``dflash-pipeline`` command offers its commands
(:mod:`dfp_dev.commands`) where it is installed.
"""
