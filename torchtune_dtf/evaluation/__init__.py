"""Looking at what a trained routed model does, after (or without) training.

- :mod:`torchtune_dtf.evaluation.routing_report`: held-out loss of dense, student and teacher, executed
  fraction and teacher–student agreement per routed layer (``python -m torchtune_dtf.evaluation.routing_report``).
- :mod:`torchtune_dtf.evaluation.routing_plots`: the same run drawn with matplotlib (curves, executed
  fractions, a token-level heat map, CE/CU shares, agreement).
- :mod:`torchtune_dtf.evaluation.metric_logs`: the metrics a recipe's ``DiskLogger`` wrote.
- :mod:`torchtune_dtf.evaluation.run_summary`: the summary ``routed_finetune`` logs after its final checkpoint
  (steps, tokens, losses, the saved student's executed fraction per routed layer).
"""
