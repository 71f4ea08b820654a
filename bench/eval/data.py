"""The tiny tasks' datasets, read from the JSONL files beside this one (nothing is downloaded): lm-eval
calls these through the YAMLs' `custom_dataset: !function data.<name>`."""

import json
import os

import datasets

HERE = os.path.dirname(os.path.abspath(__file__))


def _rows(name: str) -> list[dict]:
    with open(os.path.join(HERE, name)) as f:
        return [json.loads(line) for line in f if line.strip()]


def tiny_mc(**_) -> dict:
    return {"test": datasets.Dataset.from_list(_rows("tiny_mc.jsonl"))}


def tiny_qa(**_) -> dict:
    return {"test": datasets.Dataset.from_list(_rows("tiny_qa.jsonl"))}
