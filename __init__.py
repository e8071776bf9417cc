"""maceq: post-training quantization for mobile CNNs, bit-exact to the device."""

__version__ = "0.1.0"
