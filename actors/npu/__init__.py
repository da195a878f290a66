"""The NPU processor's backend: OpenVINO graphs under NPU rules, no Ray inside."""
