"""The end-of-run summary: scheme counts add up, one train loss, binary units."""

from __future__ import annotations

from zen_ext.reduction.stats import StepStats, format_bytes, mean_losses, summarize


def test_scheme_counts_are_per_slice_and_step_and_add_up():
    st = StepStats(rank=1)
    for step in range(1, 4):
        st.annotate(schemes={"emb:natural": "zen", "w:dgc": "zen" if step < 3 else "dense"}, loss=float(step))
        st.end_step(step)
    # 3 steps x 2 slices = 6 counts (the old counter gave zen x2: once per step it appeared).
    assert sum(st.schemes.values()) == 6
    assert st.schemes[("emb:natural", "zen")] == 3 and st.schemes[("w:dgc", "dense")] == 1
    text = summarize([{"bytes_sent": 1, "dense_bytes": 2, "sync_s": 0.1}], 3, st.schemes, [3.0, 2.0])
    assert "    emb:natural -> zen x3" in text and "    w:dgc -> zen x2, dense x1" in text


def test_bucket_lists_count_each_part():
    st = StepStats(rank=1)
    st.annotate(schemes=["dense", "agsparse"])
    st.end_step(1)
    assert st.schemes == {("bucket", "dense"): 1, ("bucket", "agsparse"): 1}


def test_train_loss_is_the_mean_over_ranks():
    assert mean_losses([{"losses": [1.0, 2.0]}, {"losses": [3.0, 4.0, 5.0]}], [9.0]) == [2.0, 3.0]
    assert mean_losses([{"losses": []}, {}], [9.0]) == [9.0]  # nobody sent losses: this rank's
    text = summarize([{"bytes_sent": 1, "dense_bytes": 2, "sync_s": 0.1}], 2, {}, [2.0, 3.0])
    assert "train loss:      2.0000 -> 3.0000" in text and text.count("loss:") == 1


def test_sizes_are_binary_units():
    assert format_bytes(124_008_132) == "118.3 MiB"
    assert format_bytes(1023) == "1023 B" and format_bytes(2048) == "2.0 KiB"


def test_the_synchronizer_s_slice_record_wins_over_its_scheme_list():
    st = StepStats(rank=1)
    st.annotate(schemes=["dense", "sparcml"], slice_schemes={"dense slices": "dense", "w:dgc": "sparcml"})
    st.end_step(1)
    assert st.schemes == {("dense slices", "dense"): 1, ("w:dgc", "sparcml"): 1}
