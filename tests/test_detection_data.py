"""Detection annotations (tasks/detection_data.py): VOC XML, COCO JSON and YOLO txt readers, their validation messages,
class mapping; real data: ../shared/data/detection (BCCD, fruit-test)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import shared_path
from qdeploy.errors import DataError, UnreadableImage
from qdeploy.tasks.detection_data import (COCO80, DetectionSample, map_classes, read_coco, read_voc, read_voc_xml,
                                          read_yolo, skipped_boxes, yolo_names, yolo_split_images)


# ------------------------------------------------------------------------------------------------------- helpers
def image(path: Path, size=(64, 48)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (90, 120, 30)).save(path)
    return path


def voc_xml(path: Path, objects=(("cat", (10, 10, 30, 30)),), size=(64, 48), filename=None, folder=None) -> Path:
    size_xml = "" if size is None else (f"<size><width>{size[0]}</width><height>{size[1]}</height>"
                                        "<depth>3</depth></size>")
    objs = "".join(f"<object><name>{n}</name><bndbox><xmin>{b[0]}</xmin><ymin>{b[1]}</ymin><xmax>{b[2]}</xmax>"
                   f"<ymax>{b[3]}</ymax></bndbox></object>" for n, b in objects)
    fn = f"<filename>{filename}</filename>" if filename else ""
    fo = f"<folder>{folder}</folder>" if folder else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"<annotation>{fo}{fn}{size_xml}{objs}</annotation>")
    return path


def one_voc(tmp_path, objects=(("cat", (10, 10, 30, 30)),), size=(64, 48), image_size=(64, 48)) -> Path:
    image(tmp_path / "a.jpg", image_size)
    return voc_xml(tmp_path / "a.xml", objects, size)


def raises(match_parts, fn, *args, error=DataError, **kwargs) -> str:
    with pytest.raises(error) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    for part in match_parts:
        assert part in msg, f"{part!r} not in {msg!r}"
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------------------------------------------ VOC good
def test_voc_xml_reads_boxes_and_size(tmp_path):
    s = read_voc_xml(one_voc(tmp_path, (("cat", (10, 10, 30, 30)), ("dog", (1.5, 2, 63, 47)))))
    assert isinstance(s, DetectionSample)
    assert s.image == tmp_path / "a.jpg" and (s.width, s.height) == (64, 48)
    assert s.boxes.dtype == np.float32 and s.boxes.shape == (2, 4)
    np.testing.assert_array_equal(s.boxes, [[10, 10, 30, 30], [1.5, 2, 63, 47]])
    assert s.classes == ["cat", "dog"] and s.skipped == []


def test_voc_zero_boxes_is_a_valid_sample(tmp_path):
    s = read_voc_xml(one_voc(tmp_path, objects=()))
    assert s.boxes.shape == (0, 4) and s.classes == []


def test_voc_size_zero_or_missing_taken_from_image(tmp_path):
    image(tmp_path / "a.jpg", (80, 50))
    assert read_voc_xml(voc_xml(tmp_path / "a.xml", size=(0, 0))).width == 80
    s = read_voc_xml(voc_xml(tmp_path / "a.xml", size=None))
    assert (s.width, s.height) == (80, 50)


def test_box_beyond_the_image_by_at_most_one_pixel_is_clipped(tmp_path):
    s = read_voc_xml(one_voc(tmp_path, (("cat", (-1, -0.5, 65, 49)),)))
    np.testing.assert_array_equal(s.boxes, [[0, 0, 64, 48]])


def test_voc_flat_folder_and_unannotated_images(tmp_path):
    one_voc(tmp_path)
    image(tmp_path / "b.png")
    raises(["b.png", "has no annotation"], read_voc, tmp_path)
    samples = read_voc(tmp_path, unannotated="empty")
    assert [s.image.name for s in samples] == ["a.jpg", "b.png"]
    assert len(samples[1].boxes) == 0


def test_voc_image_found_by_filename(tmp_path):
    image(tmp_path / "photo.jpg")
    s = read_voc_xml(voc_xml(tmp_path / "ann.xml", filename="photo.jpg"))
    assert s.image == tmp_path / "photo.jpg"


def test_bad_boxes_skip_lists_every_box_left_out(tmp_path):
    s = read_voc_xml(one_voc(tmp_path, (("cat", (5, 5, 5, 5)), ("dog", (1, 1, 9, 9)), ("cat", (0, 0, 90, 9)))),
                     bad_boxes="skip")
    assert s.classes == ["dog"] and len(s.boxes) == 1
    assert len(s.skipped) == 2 and all("a.xml" in m for m in s.skipped)
    assert "xmax <= xmin" in s.skipped[0] and "outside" in s.skipped[1]
    assert skipped_boxes([s, s]) == s.skipped * 2


# ------------------------------------------------------------------------------------------------------- VOC bad
def test_voc_box_outside_image(tmp_path):
    xml = one_voc(tmp_path, (("cat", (10, 10, 66, 30)),))
    raises([str(xml), "box 1", "outside the 64x48 image by more than 1 pixel"], read_voc_xml, xml)


def test_voc_xmax_not_above_xmin(tmp_path):
    xml = one_voc(tmp_path, (("cat", (1, 1, 5, 5)), ("cat", (30, 10, 20, 30))))
    raises([str(xml), "box 2", "xmax <= xmin"], read_voc_xml, xml)


def test_voc_ymax_not_above_ymin(tmp_path):
    xml = one_voc(tmp_path, (("cat", (10, 30, 20, 30)),))
    raises([str(xml), "box 1", "ymax <= ymin"], read_voc_xml, xml)


def test_voc_box_without_area_inside_the_image(tmp_path):
    xml = one_voc(tmp_path, (("cat", (64, 10, 64.5, 20)),))
    raises([str(xml), "no area inside"], read_voc_xml, xml)


def test_voc_unknown_class(tmp_path):
    xml = one_voc(tmp_path, (("cat", (1, 1, 5, 5)), ("zebra", (1, 1, 5, 5))))
    raises([str(xml), "box 2", "'zebra'", "'cat', 'dog'"], read_voc_xml, xml, classes=["cat", "dog"])


def test_voc_empty_file(tmp_path):
    image(tmp_path / "a.jpg")
    (tmp_path / "a.xml").write_text("")
    raises([str(tmp_path / "a.xml"), "is empty"], read_voc_xml, tmp_path / "a.xml")


def test_voc_unparsable_file(tmp_path):
    image(tmp_path / "a.jpg")
    (tmp_path / "a.xml").write_text("<annotation><object>")
    raises([str(tmp_path / "a.xml"), "not valid XML"], read_voc_xml, tmp_path / "a.xml")


def test_voc_not_an_annotation(tmp_path):
    image(tmp_path / "a.jpg")
    (tmp_path / "a.xml").write_text("<svg></svg>")
    raises([str(tmp_path / "a.xml"), "not a Pascal VOC annotation"], read_voc_xml, tmp_path / "a.xml")


def test_voc_coordinate_not_a_number(tmp_path):
    xml = one_voc(tmp_path, (("cat", (1, 1, "ten", 5)),))
    raises([str(xml), "object 1 (cat) <xmax>", "'ten', not a number"], read_voc_xml, xml)


def test_voc_object_without_name(tmp_path):
    xml = one_voc(tmp_path, (("", (1, 1, 5, 5)),))
    raises([str(xml), "object 1 has no <name>"], read_voc_xml, xml)


def test_voc_annotation_without_its_image(tmp_path):
    xml = voc_xml(tmp_path / "a.xml")
    raises([str(xml), "has no <filename>: no such image in", "nor an image named a.*", str(tmp_path)], read_voc_xml, xml)
    xml = voc_xml(tmp_path / "a.xml", filename="photo.jpg")
    raises([str(xml), "refers to image 'photo.jpg'", "no such image in", "nor an image named a.*"],
           read_voc_xml, xml)


def test_voc_image_that_does_not_decode(tmp_path):
    xml = one_voc(tmp_path)
    data = (tmp_path / "a.jpg").read_bytes()
    (tmp_path / "a.jpg").write_bytes(data[: len(data) // 2])
    raises([str(tmp_path / "a.jpg")], read_voc_xml, xml, error=UnreadableImage)
    (tmp_path / "a.jpg").write_bytes(b"not an image at all")
    raises([str(tmp_path / "a.jpg"), "corrupt or not an image"], read_voc_xml, xml, error=UnreadableImage)


def test_voc_size_differs_from_image(tmp_path):
    xml = one_voc(tmp_path, size=(48, 64))
    raises([str(xml), "gives image size 48x64", "is 64x48"], read_voc_xml, xml)


def test_voc_layout_missing_split_names_the_splits(tmp_path):
    (tmp_path / "Annotations").mkdir()
    (tmp_path / "JPEGImages").mkdir()
    (tmp_path / "ImageSets" / "Main").mkdir(parents=True)
    (tmp_path / "ImageSets" / "Main" / "train.txt").write_text("x\n")
    raises(["val.txt", "does not exist", "splits here: train"], read_voc, tmp_path, "val")
    raises(["lists x", "x.xml", "does not exist"], read_voc, tmp_path, "train")


# ------------------------------------------------------------------------------------------- VOC: published layouts
def side_by_side(root: Path, names=("b", "a", "c"), ann="annotations", imgs="images", ext=".jpg") -> Path:
    """The Kaggle / Roboflow export: annotations/<x>.xml beside images/<x>.jpg, each XML's <filename> naming its image."""
    for n in names:
        image(root / imgs / f"{n}{ext}")
        voc_xml(root / ann / f"{n}.xml", filename=f"{n}{ext}", folder=imgs)
    return root


@pytest.mark.parametrize("ann, imgs, ext", [("annotations", "images", ".jpg"), ("Annotations", "Images", ".png"),
                                            ("annotation", "JPEGImages", ".jpeg")])
def test_voc_annotations_and_images_side_by_side(tmp_path, ann, imgs, ext):
    side_by_side(tmp_path, ann=ann, imgs=imgs, ext=ext)
    samples = read_voc(tmp_path)
    assert [s.image for s in samples] == [tmp_path / imgs / f"{n}{ext}" for n in "abc"]
    assert [s.annotation for s in samples] == [tmp_path / ann / f"{n}.xml" for n in "abc"]
    assert all(s.classes == ["cat"] for s in samples)


def test_voc_image_from_filename_folder_or_the_xml_name(tmp_path):
    image(tmp_path / "images" / "IMG_1.JPG")
    voc_xml(tmp_path / "annotations" / "one.xml", filename="img_1.jpg")  # another case than the file's
    image(tmp_path / "shots" / "two.png")
    voc_xml(tmp_path / "annotations" / "two.xml", filename="two.png", folder="shots")  # <folder> below the root
    image(tmp_path / "images" / "three.bmp")
    voc_xml(tmp_path / "annotations" / "three.xml", filename="C:\\labelImg\\old\\renamed.jpg")  # stale: the XML's name
    image(tmp_path / "images" / "four.jpg")
    voc_xml(tmp_path / "annotations" / "four.xml", filename="four")  # no extension
    got = {s.annotation.stem: s.image for s in read_voc(tmp_path)}
    assert got == {"one": tmp_path / "images" / "IMG_1.JPG", "two": tmp_path / "shots" / "two.png",
                   "three": tmp_path / "images" / "three.bmp", "four": tmp_path / "images" / "four.jpg"}


def test_voc_filename_wins_over_an_image_of_the_xml_name(tmp_path):
    image(tmp_path / "images" / "photo.jpg", (64, 48))
    image(tmp_path / "images" / "x.jpg", (32, 32))
    voc_xml(tmp_path / "annotations" / "x.xml", filename="photo.jpg")
    voc_xml(tmp_path / "annotations" / "photo2.xml", size=(32, 32), filename="x.jpg")
    assert {s.annotation.stem: s.image.name for s in read_voc(tmp_path)} == {"x": "photo.jpg", "photo2": "x.jpg"}


def test_voc_folder_relative_to_the_parent_of_the_root(tmp_path):
    image(tmp_path / "pics" / "a.jpg")
    voc_xml(tmp_path / "set" / "a.xml", filename="a.jpg", folder="pics")
    assert read_voc(tmp_path / "set")[0].image == tmp_path / "pics" / "a.jpg"


def test_voc_root_at_the_annotations_folder_finds_images_beside_it(tmp_path):
    side_by_side(tmp_path, ann="Annotations", imgs="images")
    for xml in (tmp_path / "Annotations").iterdir():  # no <folder>: found as the annotations folder's sibling
        xml.write_text(xml.read_text().replace("<folder>images</folder>", ""))
    samples = read_voc(tmp_path / "Annotations")
    assert [s.image for s in samples] == [tmp_path / "images" / f"{n}.jpg" for n in "abc"]


def test_voc_xmls_beside_their_images_in_images(tmp_path):
    for n in "ab":
        image(tmp_path / "images" / f"{n}.jpg")
        voc_xml(tmp_path / "images" / f"{n}.xml", filename=f"{n}.jpg")
    assert [s.image.name for s in read_voc(tmp_path)] == ["a.jpg", "b.jpg"]


def test_voc_side_by_side_image_without_annotation(tmp_path):
    side_by_side(tmp_path, names=("a",))
    image(tmp_path / "images" / "z.png")
    raises([str(tmp_path / "images" / "z.png"), "has no annotation", "unannotated: empty"], read_voc, tmp_path)
    samples = read_voc(tmp_path, unannotated="empty")
    assert [(s.image.name, len(s.boxes)) for s in samples] == [("a.jpg", 1), ("z.png", 0)]


def test_voc_split_files_select_in_the_side_by_side_layout_too(tmp_path):
    side_by_side(tmp_path)
    (tmp_path / "ImageSets" / "Main").mkdir(parents=True)
    (tmp_path / "ImageSets" / "Main" / "val.txt").write_text("c\na\n")
    assert [s.image.name for s in read_voc(tmp_path, "val")] == ["c.jpg", "a.jpg"]  # the split file's order


def test_voc_split_without_split_files(tmp_path):
    side_by_side(tmp_path)
    raises([str(tmp_path), "no split files", "ImageSets/Main/val.txt", "leave split out"], read_voc, tmp_path, "val")


# -------------------------------------------------------------------------------------------- VOC: what is missing
def test_voc_images_folder_missing_names_the_xml_and_the_folders(tmp_path):
    voc_xml(tmp_path / "annotations" / "a.xml", filename="a.jpg", folder="images")
    msg = raises([str(tmp_path / "annotations" / "a.xml"), "refers to image 'a.jpg'", "nor an image named a.*",
                  str(tmp_path / "annotations")], read_voc, tmp_path)
    assert str(tmp_path / "images") in msg  # the folder <folder> names, looked for although absent


def test_voc_xml_pointing_to_a_missing_image(tmp_path):
    side_by_side(tmp_path, names=("a",))
    voc_xml(tmp_path / "annotations" / "b.xml", filename="gone.jpg")
    raises([str(tmp_path / "annotations" / "b.xml"), "'gone.jpg'", str(tmp_path / "images"),
            str(tmp_path / "annotations")], read_voc, tmp_path)


def test_voc_many_missing_images_are_one_message_with_examples(tmp_path):
    (tmp_path / "images").mkdir()
    for i in range(5):
        voc_xml(tmp_path / "annotations" / f"{i}.xml", filename=f"{i}.jpg")
    msg = raises(["5 annotations have no image", "0.xml", "1.xml", "2.xml", ", ...", f"looked in {tmp_path / 'images'}"],
                 read_voc, tmp_path)
    assert "3.xml" not in msg and "4.xml" not in msg


@pytest.mark.parametrize("make, parts", [
    (lambda r: image(r / "images" / "a.jpg"), ["accepted layouts", "annotations/ + images/ side by side",
                                               "Annotations/ + JPEGImages/"]),
    (lambda r: (image(r / "train" / "a.jpg"), voc_xml(r / "train" / "a.xml"), voc_xml(r / "valid" / "b.xml")),
     ["train", "valid", "set root to"]),
    (lambda r: (image(r / "images" / "a.jpg"), (r / "labels").mkdir(), (r / "labels" / "a.txt").write_text("0 .5 .5 .1 .1")),
     ["YOLO labels? set format: yolo"]),
    (lambda r: (image(r / "images" / "a.jpg"), (r / "annotations").mkdir(), (r / "annotations" / "x.json").write_text("{}")),
     [str(Path("annotations")), "set format: coco"]),
])
def test_voc_without_xmls_says_where_it_looked_and_what_it_accepts(tmp_path, make, parts):
    make(tmp_path)
    raises([f"VOC data folder {tmp_path} has no .xml annotations", f"looked in {tmp_path}", *parts], read_voc, tmp_path)


def test_voc_two_annotations_of_one_image(tmp_path):
    image(tmp_path / "a.jpg")
    voc_xml(tmp_path / "a.xml", filename="a.jpg")
    voc_xml(tmp_path / "copy.xml", filename="a.jpg")
    raises(["a.xml", "copy.xml", "both refer to image", "a.jpg"], read_voc, tmp_path)


def test_voc_root_that_is_a_data_yaml(tmp_path):
    (tmp_path / "data.yaml").write_text("names: [cat]\n")
    raises(["is not a folder", "set format: yolo"], read_voc, tmp_path / "data.yaml")


# ---------------------------------------------------------------------------------------------------------- COCO
def coco(tmp_path, annotations=None, images=None, categories=None, raw=None) -> Path:
    image(tmp_path / "img" / "a.jpg")
    image(tmp_path / "img" / "b.jpg", (32, 32))
    data = {"images": images if images is not None else
            [{"id": 7, "file_name": "a.jpg", "width": 64, "height": 48},
             {"id": 9, "file_name": "b.jpg", "width": 32, "height": 32}],
            "annotations": annotations if annotations is not None else
            [{"id": 1, "image_id": 7, "category_id": 3, "bbox": [10, 5, 20, 10]}],
            "categories": categories if categories is not None else [{"id": 3, "name": "cat"}]}
    path = tmp_path / "ann.json"
    path.write_text(raw if raw is not None else json.dumps(data))
    return path


def test_coco_reads_xywh_as_xyxy_and_images_without_boxes(tmp_path):
    a, b = read_coco(coco(tmp_path), tmp_path / "img")
    np.testing.assert_array_equal(a.boxes, [[10, 5, 30, 15]])
    assert a.classes == ["cat"] and b.image.name == "b.jpg" and b.boxes.shape == (0, 4)


@pytest.mark.parametrize("raw, parts", [
    ("", ["is empty"]),
    ("{not json", ["not valid JSON"]),
    ("[]", ["not a COCO annotation file"]),
    ('{"images": [], "categories": []}', ["no 'annotations' list"]),
])
def test_coco_unparsable(tmp_path, raw, parts):
    path = coco(tmp_path, raw=raw)
    raises([str(path), *parts], read_coco, path, tmp_path / "img")


@pytest.mark.parametrize("ann, parts", [
    ({"id": 4, "image_id": 8, "category_id": 3, "bbox": [1, 1, 2, 2]}, ["annotation 4", "image id 8"]),
    ({"id": 4, "image_id": 7, "category_id": 5, "bbox": [1, 1, 2, 2]}, ["annotation 4", "category_id 5"]),
    ({"id": 4, "image_id": 7, "category_id": 3, "bbox": [1, 1, 2]}, ["annotation 4", "expected [x, y, width"]),
    ({"id": 4, "image_id": 7, "category_id": 3, "bbox": [1, 1, 0, 2]}, ["annotation 4", "xmax <= xmin"]),
    ({"id": 4, "image_id": 7, "category_id": 3, "bbox": [50, 1, 20, 2]}, ["annotation 4", "outside the 64x48"]),
])
def test_coco_bad_annotation(tmp_path, ann, parts):
    path = coco(tmp_path, annotations=[ann])
    raises([str(path), *parts], read_coco, path, tmp_path / "img")


def test_coco_unknown_class_missing_image_duplicate_id(tmp_path):
    path = coco(tmp_path)
    raises([str(path), "annotation 1", "'cat'", "'dog'"], read_coco, path, tmp_path / "img", classes=["dog"])
    path = coco(tmp_path, images=[{"id": 7, "file_name": "gone.jpg", "width": 64, "height": 48}])
    raises([str(path), "gone.jpg", "does not exist"], read_coco, path, tmp_path / "img")
    path = coco(tmp_path, images=[{"id": 7, "file_name": "a.jpg"}, {"id": 7, "file_name": "b.jpg"}])
    raises([str(path), "image id 7 is listed twice"], read_coco, path, tmp_path / "img")
    path = coco(tmp_path, images=[{"id": 7, "file_name": "a.jpg", "width": "wide", "height": 48}])
    raises([str(path), "gives image size 'wide'x48, not numbers"], read_coco, path, tmp_path / "img")
    path = coco(tmp_path, images=[{"id": 7, "file_name": "a.jpg", "width": 640, "height": 480}])
    raises([str(path), "gives image size 640x480", "is 64x48"], read_coco, path, tmp_path / "img")


# ---------------------------------------------------------------------------------------------------------- YOLO
def yolo(tmp_path, lines: str = "0 0.5 0.5 0.25 0.5\n", name="a") -> Path:
    image(tmp_path / "images" / "train" / f"{name}.jpg", (64, 48))
    txt = tmp_path / "labels" / "train" / f"{name}.txt"
    txt.parent.mkdir(parents=True, exist_ok=True)
    txt.write_text(lines)
    return txt


def test_yolo_normalized_to_pixels_with_ultralytics_layout(tmp_path):
    yolo(tmp_path, "0 0.5 0.5 0.25 0.5\n1 0.25 0.25 0.5 0.5\n")
    yolo(tmp_path, "", name="b")  # an empty label file: no boxes
    (tmp_path / "data.yaml").write_text("names: {0: cat, 1: dog}\n")
    a, b = read_yolo(tmp_path / "images", tmp_path / "data.yaml")
    np.testing.assert_allclose(a.boxes, [[24, 12, 40, 36], [0, 0, 32, 24]])
    assert a.classes == ["cat", "dog"] and a.annotation == tmp_path / "labels" / "train" / "a.txt"
    assert b.boxes.shape == (0, 4)


def test_yolo_labels_beside_images_and_explicit_labels_folder(tmp_path):
    image(tmp_path / "x" / "a.jpg")
    (tmp_path / "x" / "a.txt").write_text("0 0.5 0.5 0.5 0.5\n")
    assert read_yolo(tmp_path / "x", ["cat"])[0].classes == ["cat"]
    image(tmp_path / "pics" / "a.jpg")
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / "a.txt").write_text("0 0.5 0.5 0.5 0.5\n")
    assert read_yolo(tmp_path / "pics", ["cat"], labels=tmp_path / "lab")[0].annotation == tmp_path / "lab" / "a.txt"


@pytest.mark.parametrize("lines, parts", [
    ("0 0.5 0.5 0.2 0.2 0.9\n", ["line 1", "has 6 fields, expected 5"]),
    ("0 0.5 0.5 0.2 0.2\n2 0.5 0.5 0.2 0.2\n", ["line 2", "class index 2", "2 classes"]),
    ("cat 0.5 0.5 0.2 0.2\n", ["line 1", "not 'class cx cy w h' numbers"]),
    ("0 0.9 0.5 0.4 0.2\n", ["line 1", "outside the 64x48 image"]),
    ("0 0.5 0.5 0 0.2\n", ["line 1", "xmax <= xmin"]),
])
def test_yolo_bad_lines(tmp_path, lines, parts):
    txt = yolo(tmp_path, lines)
    raises([str(txt), *parts], read_yolo, tmp_path / "images", ["cat", "dog"])


def test_yolo_missing_label_file_and_names(tmp_path):
    image(tmp_path / "images" / "a.jpg")
    raises([str(tmp_path / "images" / "a.jpg"), "has no label file"], read_yolo, tmp_path / "images", ["cat"])
    assert read_yolo(tmp_path / "images", ["cat"], unannotated="empty")[0].boxes.shape == (0, 4)
    (tmp_path / "data.yaml").write_text("nc: 2\n")
    raises([str(tmp_path / "data.yaml"), "no 'names' list"], yolo_names, tmp_path / "data.yaml")


# ------------------------------------------------------------------------------------------ YOLO: data.yaml (Ultralytics)
def ultralytics(root: Path, names="{0: cat, 1: dog}", splits=("train", "val"), extra="") -> Path:
    """Ultralytics' layout: images/<split>/x.jpg, labels/<split>/x.txt and a data.yaml with path, splits and names."""
    for split in splits:
        for n, line in (("a", "0 0.5 0.5 0.25 0.5"), ("b", "1 0.25 0.25 0.5 0.5")):
            image(root / "images" / split / f"{split}_{n}.jpg")
            (root / "labels" / split).mkdir(parents=True, exist_ok=True)
            (root / "labels" / split / f"{split}_{n}.txt").write_text(line + "\n")
    entries = "".join(f"{split}: images/{split}\n" for split in splits)
    (root / "data.yaml").write_text(f"path: .\n{entries}names: {names}\n{extra}")
    return root / "data.yaml"


def test_yolo_data_yaml_gives_names_and_the_split_images(tmp_path):
    data = ultralytics(tmp_path)
    samples = read_yolo(data, split="val")
    assert [s.image.name for s in samples] == ["val_a.jpg", "val_b.jpg"]
    assert [s.classes for s in samples] == [["cat"], ["dog"]]
    assert samples[0].annotation == tmp_path / "labels" / "val" / "val_a.txt"
    assert yolo_names(data) == ["cat", "dog"]
    assert [s.image.name for s in read_yolo(tmp_path / "images" / "train", data)] == ["train_a.jpg", "train_b.jpg"]


def test_yolo_data_yaml_path_key_and_list_of_folders(tmp_path):
    ultralytics(tmp_path / "datasets" / "set")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "set.yaml").write_text("path: ../datasets/set\ntrain: [images/train, images/val]\n"
                                               "names: [cat, dog]\n")
    assert len(read_yolo(tmp_path / "cfg" / "set.yaml", split="train")) == 4


def test_yolo_data_yaml_roboflow_entries_above_the_file(tmp_path):
    """Roboflow writes train: ../train/images in a data.yaml that sits beside train/."""
    for split in ("train", "valid"):
        image(tmp_path / split / "images" / "x.jpg")
        (tmp_path / split / "labels").mkdir(parents=True)
        (tmp_path / split / "labels" / "x.txt").write_text("0 0.5 0.5 0.5 0.5\n")
    (tmp_path / "data.yaml").write_text("train: ../train/images\nval: ../valid/images\nnc: 1\nnames: ['cell']\n")
    s, = read_yolo(tmp_path / "data.yaml", split="val")
    assert s.image == tmp_path / "valid" / "images" / "x.jpg" and s.classes == ["cell"]


def test_yolo_data_yaml_image_list_file(tmp_path):
    ultralytics(tmp_path, splits=("train",))
    (tmp_path / "val.txt").write_text("./images/train/train_b.jpg\n\nimages/train/train_a.jpg\n")
    (tmp_path / "data.yaml").write_text("val: val.txt\nnames: [cat, dog]\n")
    assert [p.name for p, _ in yolo_split_images(tmp_path / "data.yaml", "val")] == ["train_b.jpg", "train_a.jpg"]
    (tmp_path / "val.txt").write_text("images/train/gone.jpg\n")
    raises([str(tmp_path / "val.txt"), "line 1", "gone.jpg", "does not exist"], read_yolo, tmp_path / "data.yaml",
           split="val")


def test_yolo_data_yaml_split_missing_or_not_found(tmp_path):
    data = ultralytics(tmp_path)
    raises([str(data), "no 'test' images", "its splits: train, val", "set split: val"], read_yolo, data, split="test")
    data.write_text("path: .\nval: pictures/val\nnames: [cat, dog]\n")
    raises([str(data), "val entry 'pictures/val' does not exist", str(tmp_path / "pictures" / "val")], read_yolo, data,
           split="val")


def test_yolo_darknet_names_file(tmp_path):
    yolo(tmp_path, "1 0.5 0.5 0.25 0.5\n")
    (tmp_path / "obj.names").write_text("cat\ndog\n\n")
    assert yolo_names(tmp_path / "obj.names") == ["cat", "dog"]
    assert read_yolo(tmp_path / "images", tmp_path / "obj.names")[0].classes == ["dog"]
    (tmp_path / "obj.names").write_text("cat\ncat\n")
    raises([str(tmp_path / "obj.names"), "'cat' twice", "lines 1 and 2"], yolo_names, tmp_path / "obj.names")


@pytest.mark.parametrize("text, parts", [
    ("nc: 2\ntrain: images/train\n", ["no 'names' list", "it has nc: 2"]),
    ("names: {0: cat, 2: dog}\n", ["'names' has no entry for class index 1", "0..2 without gaps"]),
    ("names: {0: cat, one: dog}\n", ["'names' key 'one' is not a class index"]),
    ("names: [cat, dog\n", ["is not valid YAML", "line 2"]),
    ("", ["is empty"]),
    ("- cat\n- dog\n", ["is not a mapping", "names"]),
    ("names: cat\n", ["'names' is 'cat', expected a list"]),
    ("names: []\n", ["'names' is [], expected a list"]),
    ("names: [cat, '']\n", ["'names' entry 1 is ''"]),
    ("names: [cat, dog, cat]\n", ["'cat' twice", "entries 0 and 2"]),
    ("nc: 3\nnames: [cat, dog]\n", ["'nc' is 3 but 'names' has 2 classes"]),
])
def test_yolo_bad_data_yaml(tmp_path, text, parts):
    (tmp_path / "data.yaml").write_text(text)
    raises([f"YOLO data file {tmp_path / 'data.yaml'}", *parts], yolo_names, tmp_path / "data.yaml")


def test_yolo_data_yaml_missing_and_string_keys(tmp_path):
    raises([str(tmp_path / "data.yaml"), "does not exist"], yolo_names, tmp_path / "data.yaml")
    (tmp_path / "data.yaml").write_text("names: {'1': dog, '0': cat}\n")
    assert yolo_names(tmp_path / "data.yaml") == ["cat", "dog"]


# --------------------------------------------------------------------------------------------------- map_classes
def test_map_classes_to_coco80():
    assert len(COCO80) == 80 and len(set(COCO80)) == 80
    np.testing.assert_array_equal(map_classes(["banana", "apple", "orange", "person"], COCO80), [46, 47, 49, 0])
    np.testing.assert_array_equal(map_classes(["Dining_Table", "TV", "teddy-bear"], COCO80), [60, 62, 77])


def test_map_classes_lists_every_unknown_name():
    msg = raises(["2 annotation class name(s)", "'RBC'", "'WBC'", "80 classes", "'person'"],
                 map_classes, ["RBC", "apple", "WBC", "RBC"], COCO80)
    assert msg.count("'RBC'") == 1


# ----------------------------------------------------------------------------------------------------- real data
@pytest.mark.realdata
def test_bccd_splits_counts_and_two_point_boxes():
    root = shared_path("data", "detection", "bccd")
    raises(["BloodImage_00343.xml", "box 4 [181 329 181 329] has xmax <= xmin", "bad_boxes: skip"],
           read_voc, root, "train")
    counts, boxes, classes, skipped = {}, 0, set(), []
    for split in ("train", "val", "test"):
        samples = read_voc(root, split, classes=["RBC", "WBC", "Platelets"], bad_boxes="skip")
        counts[split] = len(samples)
        boxes += sum(len(s.boxes) for s in samples)
        classes |= {c for s in samples for c in s.classes}
        skipped += skipped_boxes(samples)
        assert all((s.width, s.height) == (640, 480) for s in samples)
    assert counts == {"train": 205, "val": 87, "test": 72}
    assert classes == {"RBC", "WBC", "Platelets"}
    assert len(skipped) == 2 and boxes + len(skipped) == 4888  # the README's 4,888: two are zero-size points
    assert len(read_voc(root, "trainval", decode=False, bad_boxes="skip")) == 292


@pytest.mark.realdata
def test_fruit_test_sizes_from_images_and_coco80_mapping():
    root = shared_path("data", "detection", "fruit-test")
    samples = read_voc(root, classes=["apple", "banana", "orange"])
    assert len(samples) == 60 and sum(len(s.boxes) for s in samples) == 117
    zero = [s for s in samples if "<width>0</width>" in s.annotation.read_text()]
    assert zero, "the README says some XMLs give width/height 0"
    for s in zero:
        with Image.open(s.image) as img:
            assert (s.width, s.height) == img.size
    ids = map_classes([c for s in samples for c in s.classes], COCO80)
    assert set(ids.tolist()) == {46, 47, 49}


# ----------------------------------------------------------------------------- data sets: build_dataset, the README
def build(spec: dict, size=16):
    from qdeploy.config import DatasetSpec, Preprocess
    from qdeploy.data import build_dataset

    return build_dataset(DatasetSpec(**spec).keyed("data.eval"), Preprocess(input_size=(size, size)), "detection")


def test_yolo_names_are_the_model_classes_when_classes_are_not_given(tmp_path):
    data = ultralytics(tmp_path, names="{0: cat, 1: dog, 2: bird}")
    ds = build({"format": "yolo", "root": str(tmp_path / "images" / "val"), "names": str(data)})
    assert ds.class_names == ["cat", "dog", "bird"] and len(ds) == 2
    assert [labels.tolist() for _, labels in ds.samples] == [[0], [1]]
    image_, table = ds[1]
    assert image_.shape == (3, 16, 16) and table.shape[0] == 2
    ds = build({"format": "yolo", "root": str(data), "split": "train"})  # root: the data.yaml itself
    assert ds.class_names == ["cat", "dog", "bird"] and [p.rsplit("/", 1)[1] for p, _ in ds.samples] == \
        ["train_a.jpg", "train_b.jpg"]
    ds = build({"format": "yolo", "root": str(data), "split": "val", "classes": ["bird", "dog", "cat"]})
    assert [labels.tolist() for _, labels in ds.samples] == [[2], [1]]  # names mapped onto the model's classes


def test_detection_without_classes_or_yolo_names(tmp_path):
    side_by_side(tmp_path)
    raises(["data.eval: detection needs classes"], build, {"format": "voc", "root": str(tmp_path)})
    yolo(tmp_path, name="x")
    raises(["detection needs classes", "YOLO data: or names"], build,
           {"format": "yolo", "root": str(tmp_path / "images")})


def test_voc_split_default_reads_a_data_set_without_split_files(tmp_path):
    side_by_side(tmp_path, ann="Annotations", imgs="JPEGImages")
    assert len(build({"format": "voc", "root": str(tmp_path), "classes": ["cat"]})) == 3  # split: test, the default
    raises(["no split files", "ImageSets/Main/val.txt"], build,
           {"format": "voc", "root": str(tmp_path), "classes": ["cat"], "split": "val"})


def test_a_data_yaml_root_for_calibration_and_without_labels(tmp_path):
    from qdeploy.config import DatasetSpec, Preprocess
    from qdeploy.data import build_dataset

    data = ultralytics(tmp_path)
    spec = DatasetSpec(format="yolo", root=str(data), split="train").keyed("data.calibration")
    assert len(build_dataset(spec, Preprocess(input_size=(16, 16)), "detection")) == 2
    raises(["labels: false reads every image under a folder", str(data), "give the image folder"], build,
           {"format": "yolo", "root": str(data), "labels": False})


def _readme_detection_block() -> str:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text[text.index("### Detection"):]
    return section[section.index("```yaml") + len("```yaml"):section.index("```", section.index("```yaml") + 7)]


def _readme_fixture(root: Path):
    """The files the README's detection example names, as small real files: fruit-test (VOC), coco.names, images/ with
    a COCO JSON, images/val + labels/val with a data.yaml (Ultralytics), photos/ for calibration."""
    (root / "coco.names").write_text("\n".join(COCO80) + "\n")
    for n, cls in (("apple_1", "apple"), ("banana_1", "banana")):
        image(root / "fruit-test" / f"{n}.jpg")
        voc_xml(root / "fruit-test" / f"{n}.xml", ((cls, (4, 4, 40, 30)),), filename=f"{n}.jpg", folder="test")
    image(root / "images" / "val" / "a.jpg")
    (root / "labels" / "val").mkdir(parents=True)
    (root / "labels" / "val" / "a.txt").write_text("1 0.5 0.5 0.5 0.5\n0 0.2 0.2 0.2 0.2\n")
    (root / "data.yaml").write_text("path: .\nval: images/val\nnames:\n  0: apple\n  1: banana\n")
    (root / "instances_val.json").write_text(json.dumps({
        "images": [{"id": 1, "file_name": "val/a.jpg", "width": 64, "height": 48}],
        "annotations": [{"id": 1, "image_id": 1, "category_id": 53, "bbox": [4, 4, 20, 20]}],
        "categories": [{"id": 53, "name": "apple"}]}))
    image(root / "photos" / "p.png")


@pytest.mark.filterwarnings("ignore:count=256 but the dataset has only")  # calibration's count: one photo here
def test_readme_detection_examples_run_as_written(tmp_path, monkeypatch):
    """Each data line of the README's detection config (the active one and the commented coco / yolo ones) builds its
    data set from files laid out as the line names them, with the model's preprocessing."""
    import yaml

    from qdeploy.config import DatasetSpec, RunConfig
    from qdeploy.data import build_dataset

    block = _readme_detection_block()
    cfg = RunConfig(**yaml.safe_load(block))
    specs = {"eval": cfg.data.eval, "calibration": cfg.data.calibration}
    for n, line in enumerate(re.findall(r"^\s*#\s*((?:coco|yolo): \{.*)$", block, re.M)):
        kind, _, mapping = line.partition(": ")
        specs[f"{kind}{n}"] = DatasetSpec(**yaml.safe_load(mapping)).keyed("data.eval")
    assert sorted(specs) == ["calibration", "coco0", "eval", "yolo1", "yolo2"], specs
    _readme_fixture(tmp_path)
    monkeypatch.chdir(tmp_path)
    found = {}
    for name, spec in specs.items():
        ds = build_dataset(spec, cfg.model.preprocess, "detection")
        image_, label = ds[0]
        assert image_.shape == (3, 352, 352), name
        found[name] = (len(ds), getattr(ds, "class_names", None))
    assert found["eval"] == (2, list(COCO80)) and found["coco0"] == (1, list(COCO80))
    assert found["yolo1"] == found["yolo2"] == (1, ["apple", "banana"])
    assert found["calibration"][0] == 1
