from twisted.application.service import ServiceMaker

koordrp = ServiceMaker(
    "koordrp",
    "koordrp.tap",
    "Koordinator runtime proxy: CRI in front of containerd, with runtime hooks",
    "koordrp",
)
