"""The images of a session bag's events, with their pixels, checked against the digests the events recorded.

Every 'observe' / 'generate' event records the sha256 of each image it ingested (``image_digests``, see
:func:`flashrt_ros.image_convert.digest`) and, unless the node ran with ``image.record_pixels`` false, the image
itself (rgb8). Events without pixels take them from the bag's ``~/observation`` messages holding an image of the
same digest (any encoding: the digest is of the RGB pixels the node made of it). A replay refuses, naming the
event and the image, a bag in which an image is missing (e.g. a ``~/generate`` goal's, which only its event
carries) or whose pixels do not match their digest.
"""
from dataclasses import replace

from flashrt_ros.bag.bagfile import BagError
from flashrt_ros.image_convert import digest, to_rgb
from flashrt_ros.runtime.errors import FlashRTError


class ImageSource:
    """The images a bag holds, by digest: the ``~/observation`` messages', read when first asked for."""

    def __init__(self, records):
        self._records = records
        self._found = None

    def get(self, wanted: str):
        if self._found is None:
            self._found = {}
            for record in self._records:
                if record.topic != "observation":
                    continue
                for image in record.msg.images:
                    try:
                        self._found.setdefault(digest(to_rgb(image)), image)
                    except FlashRTError:  # an image the node refused: no event ingested it
                        continue
        return self._found.get(wanted)

    def fill(self, event):
        """``event`` with every image of its observation holding its pixels; BagError if one is missing or does
        not match its digest."""
        images, digests = list(event.observation.images), list(event.image_digests)
        if not images:
            return event
        where = f"event seq {event.seq} ({event.op})"
        if len(digests) != len(images):
            raise BagError(f"{where}: {len(images)} images but {len(digests)} image digests; the bag is corrupt")
        filled = [self._pixels(where, index, image, wanted)
                  for index, (image, wanted) in enumerate(zip(images, digests))]
        return replace(event, observation=replace(event.observation, images=filled))

    def _pixels(self, where: str, index: int, image, wanted: str):
        if len(image.data) == 0:
            found = self.get(wanted)
            if found is None:
                raise BagError(f"{where}: images[{index}] ({image.width}x{image.height}, sha256 {wanted[:16]}) is not "
                               "in the bag: its events hold image digests only (image.record_pixels false) and no "
                               "~/observation message carries that image (a ~/generate goal's images are only in its "
                               "event); record with image.record_pixels true, or record ~/observation too")
            return found
        try:
            got = digest(to_rgb(image))
        except FlashRTError as exc:
            raise BagError(f"{where}: {exc.message}; the bag is corrupt") from None
        if got != wanted:
            raise BagError(f"{where}: images[{index}] pixels have sha256 {got[:16]}, not the recorded {wanted[:16]}; "
                           "the bag is corrupt")
        return image
