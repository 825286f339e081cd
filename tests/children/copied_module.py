"""Use stocaching as a user who copied the files would: run with ``python -I`` from the
directory that holds the copy (isolated: no PYTHONPATH, no script directory on the path), so
that ``import stocaching`` can only find the copy. Prints the sum read back and the module's
path.

``python copied_module.py core``: only stocaching.py was copied. The two lines work, and each
feature's keyword raises an ImportError naming the file to copy beside it, before anything is
made. ``python copied_module.py features``: the feature modules were copied too, and every
kind of cache works.
"""

import os
import sys

sys.path.insert(0, ".")

import stocaching  # noqa: E402
import torch  # noqa: E402

c = stocaching.SharedCache(1e-4, 10, (4,))
c.set_slot(1, torch.ones(4, dtype=torch.uint8))
if sys.argv[1] == "core":
    def refused(use, file):
        try:
            use()
        except ImportError as e:
            assert f"{file} beside stocaching.py" in str(e), (file, str(e))
        else:
            raise AssertionError(f"{file} is not here, but its feature ran")

    refused(lambda: stocaching.SharedCache(1e-4, 10, {"x": (2,)}), "fields.py")
    refused(lambda: stocaching.OpenSizeCache(1e-4, 10, (None, 2)), "open_size.py")
    refused(lambda: stocaching.SharedCache(1e-4, 10, (4,), staging_slots=1), "staging.py")
    refused(lambda: stocaching.SharedCache(1e-4, 10, (4,), disk_tier="."), "disk_tier.py")
    refused(lambda: stocaching.SharedCache(1e-4, 10, (4,), load_from="x.stc"), "saved.py")
    refused(lambda: stocaching.SharedCache(1e-4, 10, (4,), persistent=True, name="p"),
            "persistent.py")
    refused(lambda: c.get_batch([1]), "batches.py")
    refused(lambda: c.ready_mask([1]), "masks.py")
    refused(lambda: c.unstage(1), "staging.py")
    refused(lambda: c.save("x.stc"), "saved.py")
    refused(lambda: c.get_slot(2, copy=False), "views.py")  # a miss: at the first call
    refused(lambda: c.get_slot(1, copy=False), "views.py")  # a hit
    refused(lambda: stocaching.plan(10, (4,)), "cli.py")
    assert not os.path.exists("x.stc")
    # A module of the project's own with a feature's name is not taken for the feature's
    os.makedirs("other", exist_ok=True)
    with open(os.path.join("other", "fields.py"), "w") as f:
        f.write("NAME = 'a module of the project, not stocaching'\n")
    sys.path.append("other")
    try:
        stocaching.SharedCache(1e-4, 10, {"x": (2,)})
    except ImportError as e:
        assert "needs stocaching's fields.py beside stocaching.py" in str(e) and \
            os.path.join("other", "fields.py") in str(e), str(e)
    else:
        raise AssertionError("the project's fields.py was taken for stocaching's")
    sys.path.remove("other")
    assert "fields" not in sys.modules  # (refused before it ran)
    left = [f for f in os.listdir(os.environ["STOCACHING_SHM_DIR"]) if f.startswith("stocaching")]
    assert left == [c._path.rsplit("/", 1)[1]] or left == [], left  # only c's (a name, or none)
else:
    # Every kind of cache, with the feature modules beside the core.
    f = stocaching.SharedCache(1e-4, 10, {"x": (2,), "label": ()})
    f.set_slot(0, {"x": torch.ones(2, dtype=torch.uint8), "label": 7})
    assert int(f.get_slot(0)["label"]) == 7
    o = stocaching.OpenSizeCache(1e-4, 10, (None, 2))
    o.set_slot(0, torch.ones(3, 2, dtype=torch.uint8))
    assert tuple(o.get_slot(0).shape) == (3, 2)
    assert type(o.get_slot(0, copy=False)) is stocaching.ReadOnlyView
    assert c.get_batch([1])[1].tolist() == [True]
    assert c.ready_mask([0, 1]).tolist() == [False, True] and not c.unstage(1)
    assert type(c.get_slot(1, copy=False)) is stocaching.ReadOnlyView
    assert type(f.get_slot(0, copy=False)["x"]) is stocaching.ReadOnlyView
print(int(c.get_slot(1).sum()), stocaching.__file__)
