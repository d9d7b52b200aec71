// Internal: which of a manifest's variants this process can load (docs/plugins.md, "Variants").
#pragma once

#include <map>
#include <string>

#include "kernmap/plugins.h"
#include "repository/manifest.h"

namespace kernmap::repository {

/// KERNMAP_TOOLKITS ("cuda=12.8,cann=8.0") as a map; nullptr gives none. Throws std::invalid_argument for an
/// entry that is not toolkit=version.
std::map<std::string, std::string> parse_toolkits(const char* text);

/// Why the variant does not fit the process ("needs torch 2.14", "needs cuda 12 (have 11.8)"), or "" when it
/// does. A toolkit version needed as "12" accepts 12.x, "12.8" accepts 12.8 and 12.8.x.
std::string mismatch(const Variant& v, const ProcessInfo& p);

/// The variant to load: among those that fit, the one needing the most toolkits (the most specific build);
/// nullptr when none fits, with each variant's reason in why_not ("lib/a.so needs torch 2.14; ...").
const Variant* choose_variant(const Manifest& m, const ProcessInfo& p, std::string& why_not);

/// "lib/x.so (torch 2.15, cxx11_abi, x86_64, linux, cuda 12.8)", as reports list what a package offers.
std::string describe(const Variant& v);
/// "torch 2.15, cxx11_abi, x86_64, linux, toolkits: none", for the message when no variant fits.
std::string describe(const ProcessInfo& p);

}  // namespace kernmap::repository
