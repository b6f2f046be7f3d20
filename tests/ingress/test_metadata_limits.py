"""metadata keeps OpenAI's documented caps wherever an object takes it: a 400 naming the field."""
import pytest

from http_api.openai_errors import APIError
from ingress.http.metadata_limits import checked_metadata


def test_metadata_within_the_caps_is_kept():
    at_caps = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    assert checked_metadata(at_caps) == at_caps
    assert checked_metadata(None) is None


@pytest.mark.parametrize("bad, says", [
    ({f"k{i}": "v" for i in range(17)}, "17 pairs"),
    ({"k" * 65: "v"}, "keys"),
    ({"k": "v" * 513}, "values"),
    ({"k": 1}, "strings"),
    (["k"], "strings"),
])
def test_metadata_past_a_cap_is_a_400_naming_it(bad, says):
    with pytest.raises(APIError) as err:
        checked_metadata(bad)
    assert err.value.status == 400 and err.value.param == "metadata" and says in str(err.value.message)
