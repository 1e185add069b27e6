"""Explorers: vLLM engines that turn tasks from the tasks topic into experience groups (see explorer.py)."""
