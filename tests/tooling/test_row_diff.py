"""deepcomm.row_diff, which describes the wrong rows of a received tensor in GPU tests and the soak."""
import torch

from deepcomm.row_diff import differing_rows, explain_rows, received_rows


def test_equal_tensors_give_no_text():
    x = torch.randn(5, 8).to(torch.bfloat16)
    assert explain_rows(x, x.clone(), [2, 3]) == ""


def test_each_wrong_row_is_named_with_its_source_and_what_it_holds():
    want = torch.arange(80, dtype=torch.int16).reshape(10, 8)
    earlier = torch.arange(100, 140, dtype=torch.int16).reshape(5, 8)
    got = want.clone()
    got[3] = 0               # never written
    got[7] = want[1]         # another row of this call
    got[8] = earlier[2]      # a row of an earlier output
    text = explain_rows(got, want, [4, 0, 6], [earlier])
    assert text.startswith("3 of 10 rows differ (from source ranks [0, 2]; received per source [4, 0, 6]); "
                           "after a device synchronize 3 still differ")
    assert "row 3: zeros" in text
    assert "row 7: reference row 1 of this call" in text
    assert "row 8: row 2 of earlier output 0" in text


def test_only_the_first_rows_are_described():
    want = torch.zeros(6, 4, dtype=torch.int32)
    got = torch.ones(6, 4, dtype=torch.int32)
    text = explain_rows(got, want, [6], shown=2)
    assert text.count("row ") == 2 and "6 of 6 rows differ" in text


def test_differing_rows_counts_rows_or_names_a_shape_difference():
    want = torch.zeros(5, 3, dtype=torch.int32)
    got = want.clone()
    got[1, 2] = got[4, 0] = 1
    assert differing_rows(got, want) == "2"
    assert differing_rows(want[:0], want[:0]) == "0"
    assert differing_rows(got[:4], want).startswith("a different shape ((4, 3) against (5, 3))")


def test_received_rows_are_each_sources_rows_naming_the_rank_in_source_order():
    # 2 ranks, 4 experts (2 per rank): rank 1 holds experts 2 and 3
    rows0, idx0 = torch.tensor([[10], [11], [12]]), torch.tensor([[0, 2], [1, -1], [3, 3]])
    rows1, idx1 = torch.tensor([[20], [21]]), torch.tensor([[-1, -1], [2, 0]])
    assert received_rows([(rows0, idx0), (rows1, idx1)], 4, 1).flatten().tolist() == [10, 12, 21]
    assert received_rows([(rows0, idx0), (rows1, idx1)], 4, 0).flatten().tolist() == [10, 11, 21]
