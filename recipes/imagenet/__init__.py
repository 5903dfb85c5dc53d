"""Image classification (ResNet-50 on ImageNet) with All-Reduce, AccumAdam or A2CiD2 (README.md here)."""
