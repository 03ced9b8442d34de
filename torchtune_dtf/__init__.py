"""torchtune_dtf: routed (MoD, SDT, STT) Qwen2.5 models for torchtune."""
