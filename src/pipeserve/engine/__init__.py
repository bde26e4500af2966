"""The engine: one loaded model behind the contract in base.py (submit a job, stream events); runtime.py builds one."""
