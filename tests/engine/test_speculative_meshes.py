"""Speculation on meshes (8 fake CPU devices, in a subprocess: the device count is fixed when JAX starts):
data x tensor parallelism on a dense model (n-gram proposals, and a draft model: the target's int8 copy,
whose rows follow each data-parallel rank's sequences), data x expert parallelism on a mixture of experts
(n-gram and the int8 draft), guided rows among the others. Outputs equal speculation off, no compile after warm-up, no page held in
either cache; the draft's chained steps (device/step.py chained_steps) ran on the meshes too."""

from tests.support.fake_devices import run_on_fake_devices

# Cases on one fixture and mesh share the plain engine's run (tests/support/speculative_mesh_run.py).
CASES = ("llama_dp2_tp2", "llama_dp2_tp2_draft", "mixtral_dp2_ep", "mixtral_dp2_ep_draft")


def test_outputs_equal_on_data_tensor_and_expert_parallel_meshes():
    results = run_on_fake_devices("tests.support.speculative_mesh_run", *CASES, devices=8)
    for case, outcome in results.items():
        assert outcome["equal"], case
        assert outcome["accepted"] > 5, case  # proposals were verified and accepted on the mesh
        assert outcome["guided_drafted"] > 0, case  # guided rows verified proposals on the mesh too
        assert outcome["compiles_after_warmup"] == [0, 0], case
        assert outcome["pages_held"] == [0, 0], case
        assert outcome["draft_pages_held"] == 0, case
        if case.endswith("_draft"):
            assert outcome["chained_steps"] > 0, case
