"""The OpenMP settings a rank starts with: the spinning default, and the user's word first."""

from __future__ import annotations

from sglang_admin.constants import RANK_OPENMP_DEFAULTS, rank_openmp_environment


def test_ranks_spin_briefly_by_default() -> None:
    env = rank_openmp_environment({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "10000"}
    assert RANK_OPENMP_DEFAULTS == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "10000"}


def test_a_user_setting_either_variable_keeps_all_of_it() -> None:
    """OMP_WAIT_POLICY=PASSIVE alone must not get a spin count added (libgomp honours
    GOMP_SPINCOUNT whatever the policy), nor a spin count alone a policy."""
    assert rank_openmp_environment({"OMP_WAIT_POLICY": "PASSIVE"}) == {
        "OMP_WAIT_POLICY": "PASSIVE"}
    assert rank_openmp_environment({"GOMP_SPINCOUNT": "0"}) == {"GOMP_SPINCOUNT": "0"}


def test_ranks_ask_glibc_for_huge_pages_unless_the_user_chose() -> None:
    from sglang_admin.constants import rank_memory_environment

    assert rank_memory_environment({"PATH": "/bin"}) == {
        "PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    # the user's other tunables kept, the huge-page one appended
    assert rank_memory_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    # the user's own hugetlb setting wins
    assert rank_memory_environment({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
