# Writes OUT: a C++ table of the model presets in DIR/*.json, so the `moe` binary knows them
# wherever it is installed.
file(GLOB files ${DIR}/*.json)
list(SORT files)
set(body "// Generated from configs/models/*.json by cmake/embed_presets.cmake; do not edit.\n")
string(APPEND body "#include \"model/presets.h\"\n\nnamespace moe {\n\nconst std::vector<ModelPreset>& model_presets() {\n  static const std::vector<ModelPreset> presets = {\n")
foreach(f ${files})
  get_filename_component(name ${f} NAME_WE)
  file(READ ${f} content)
  string(APPEND body "    {\"${name}\", R\"moe_json(${content})moe_json\"},\n")
endforeach()
string(APPEND body "  };\n  return presets;\n}\n\n}  // namespace moe\n")
file(WRITE ${OUT}.tmp "${body}")
configure_file(${OUT}.tmp ${OUT} COPYONLY)
